"""The zoo's models, one module per family; importing registers them."""

from models import cnn, gpt, gpt_params, mlp, resnet, resnet_params, vae, vit, xor  # noqa: F401
