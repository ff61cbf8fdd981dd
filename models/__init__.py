"""The zoo's models, one module per family; importing registers them."""

from models import cnn, mlp, resnet, vit, xor  # noqa: F401
