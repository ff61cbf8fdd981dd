"""A plugin (`ZOO_PLUGINS=read_log`) that records which examples a training process makes:
each training batch's (file, epoch) pairs, appended to `$ZOO_READ_LOG.<pid>`."""

import os

from zoo.data.image_examples import ImageExamples

_examples = ImageExamples.examples


def _logged(self, rows, epochs, seed):
    if epochs is not None:
        with open(f"{os.environ['ZOO_READ_LOG']}.{os.getpid()}", "a") as log:
            pairs = zip(rows, epochs, strict=True)
            log.writelines(f"{self.payloads.name(int(r))} {int(e)}\n" for r, e in pairs)
    return _examples(self, rows, epochs, seed)


ImageExamples.examples = _logged
