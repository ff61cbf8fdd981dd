"""Running a run: the trainer and its host loop (`trainer`), what happens at which step
(`cadence`, `dispatch`, `early_stop`, `callbacks`), signals and the run directory (`signals`,
`rundir`), the model built sharded (`build`), and the config checked before anything is built
(`validate`). The front imports this face; the modules are the engine's own."""

from zoo.engine.loop.build import abstract_model, build_on_mesh, check_buildable
from zoo.engine.loop.callbacks import STOP, CallbackFailed, CallbackStop
from zoo.engine.loop.config_checks import check_keys, check_split, validate
from zoo.engine.loop.dispatch import CADENCES
from zoo.engine.loop.rundir import RunLog, check_usable
from zoo.engine.loop.signals import Interrupted
from zoo.engine.loop.trainer import RunResult, Trainer, evaluate_batches, run

__all__ = [
    "CADENCES",
    "STOP",
    "CallbackFailed",
    "CallbackStop",
    "Interrupted",
    "RunLog",
    "RunResult",
    "Trainer",
    "abstract_model",
    "build_on_mesh",
    "check_buildable",
    "check_keys",
    "check_split",
    "check_usable",
    "evaluate_batches",
    "run",
    "validate",
]
