"""Data sets (registered on import) and the generic Grain pipelines that batch them."""

from zoo.data import chat, images, tables, text, vision, xor  # noqa: F401  (registers the built-in data sets)
