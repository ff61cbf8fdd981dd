"""Data sets (registered on import) and the generic Grain pipelines that batch them."""

from data import vision, xor  # noqa: F401  (registers the built-in data sets)
