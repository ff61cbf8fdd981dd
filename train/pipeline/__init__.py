"""Data in: Grain pipelines from columns or random-access sources to fixed-shape batches
(`batches`), made in worker processes where a run asks for them (`workers`)."""

from zoo.engine.pipeline.batches import (
    MASK,
    ExampleSource,
    RandomAccess,
    WithColumns,
    eval_batches,
    training_rows,
)

__all__ = [
    "MASK",
    "ExampleSource",
    "RandomAccess",
    "WithColumns",
    "eval_batches",
    "training_rows",
]
