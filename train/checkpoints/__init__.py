"""A run's checkpoints: writing them (`manager`), reading them without writing (`reader`),
their checksums, where a run starts (`start`: its own checkpoint, another run's weights or its
seed), which checkpoint a resume takes (`resume`), another run's weights as a fine-tune's start
(`warm_start`), and the storage stack's failures in one line each (`failures`)."""

from zoo.engine.checkpoints.reader import read_json
from zoo.engine.checkpoints.resume import precheck
from zoo.engine.checkpoints.start import starting_state
from zoo.engine.checkpoints.warm_start import locate, read_first, restore_averaged, restore_model

__all__ = [
    "locate",
    "precheck",
    "read_first",
    "read_json",
    "restore_averaged",
    "restore_model",
    "starting_state",
]
