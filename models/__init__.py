"""The zoo's models, one module per family; importing registers them."""

from zoo.models import (  # noqa: F401
    cnn,
    decoder,
    decoder_params,
    gpt,
    gpt_params,
    mlp,
    resnet,
    resnet_params,
    siglip,
    siglip_params,
    vae,
    vit,
    vit_params,
    xor,
)
