"""The zoo's models, one module per family; importing registers them."""

from models import cnn, gpt, gpt_params, mlp, resnet, vae, vit, xor  # noqa: F401
