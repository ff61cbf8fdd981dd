"""The zoo's models, one module per family; importing registers them."""

from models import xor  # noqa: F401
