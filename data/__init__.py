"""Data sets (registered on import) and the generic Grain pipelines that batch them."""

from zoo.data import (  # noqa: F401  (registers the built-in data sets)
    builtin_images,
    chat,
    image_folders,
    image_tables,
    preference,
    prompts,
    shape_captions,
    text,
    xor,
)
