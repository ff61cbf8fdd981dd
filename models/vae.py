"""A variational autoencoder of images: MLP encoder -> a Gaussian posterior over a small latent
space -> MLP decoder -> per-pixel Bernoulli logits.

The loss is the negative ELBO in nats per image: the reconstruction term (binary cross-entropy
of the decoder's logits against pixel intensities in [0, 1], summed over pixels) plus the KL
divergence of the posterior from the standard normal prior; both parts are logged. Pixels must
be intensities, not standardised values, so the model's registration sets `data.normalize=false`.

The reparameterisation noise comes from an NNX stream named `noise` bound to the model at
construction (`rngs["noise"]`): its key and counter live in the model's state, advance once per
training step and are checkpointed with it, so a resumed run draws the same noise. In eval mode
(`model.eval()`) the latent is the posterior mean: eval metrics and reconstructions are
deterministic.

After each eval, the model writes to TensorBoard a grid of held-out images above their
reconstructions (`visuals/reconstructions`) and a grid of samples decoded from prior draws
(`visuals/samples`): under `visuals`, a group that TensorBoard lists after the loss curves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P
from zoo.models import hparams
from zoo.models.layers import dense, dense_stack, run_stack, split_by_fsdp, stack_output_axis

from zoo.plugin import (
    image_grid,
    logical_spec,
    loss_contract,
    register_model,
    unsplit_batch,
)


class MLPStack(nnx.Module):
    """Dense ReLU layers, alternately column- and row-parallel (`zoo.models.layers.dense_stack`)."""

    def __init__(self, sizes: list[int], *, rngs: nnx.Rngs):
        self.layers = dense_stack(sizes, rngs=rngs)

    @property
    def out_axis(self) -> str:
        return stack_output_axis(self.layers)

    def __call__(self, x: jax.Array) -> jax.Array:
        return run_stack(self.layers, x, nnx.relu)


@loss_contract(columns=("image",), metrics=("kl", "reconstruction"))
def _elbo_loss(model: VAE, batch: Mapping[str, jax.Array], rngs: nnx.Rngs):
    """Per image: negative ELBO = reconstruction + KL, in nats."""
    images = batch["image"]
    logits, mean, log_var = (x.astype(jnp.float32) for x in model(images))
    targets = images.reshape(logits.shape)
    reconstruction = jnp.sum(optax.sigmoid_binary_cross_entropy(logits, targets), axis=-1)
    kl = 0.5 * jnp.sum(jnp.exp(log_var) + mean**2 - 1.0 - log_var, axis=-1)
    return reconstruction + kl, {"reconstruction": reconstruction, "kl": kl}


def _write_images(model: VAE, report) -> None:
    """Held-out images over their reconstructions, and samples from the prior."""
    images = np.asarray(report.examples["image"][:32], np.float32)
    shape = images.shape[1:]
    with unsplit_batch():
        logits, _, _ = model(jax.sharding.reshard(jnp.asarray(images), P()))
        noise = jax.random.normal(report.key, (64, model.latent_dim), out_sharding=P())
        samples = jax.nn.sigmoid(model.decode(noise))
    reconstructions = np.asarray(jax.nn.sigmoid(logits)).reshape(-1, *shape)
    # Rows of 8 held-out images, each above the row of their reconstructions.
    rows = [part[i : i + 8] for i in range(0, len(images), 8) for part in (images, reconstructions)]
    report.image("visuals/reconstructions", image_grid(np.concatenate(rows)))
    report.image("visuals/samples", image_grid(np.asarray(samples).reshape(-1, *shape)))


@register_model(
    "vae",
    loss=_elbo_loss,
    default_data="fashion_mnist",
    data={"normalize": False},
    on_eval=_write_images,
    # Ten epochs of Fashion-MNIST.
    trainer={"steps": 4700, "batch_size": 128, "log_every": 100, "eval_every": 940},
    optimizer={"name": "adam", "learning_rate": 1e-3, "schedule": "cosine", "warmup_steps": 100},
    tiny=("data=digits", "model.hidden_sizes=[64,32]", "model.latent_dim=4"),
)
class VAE(nnx.Module):
    def __init__(
        self,
        input_shape: list[int] | None = None,  # `[height, width, channels]`; null: the data set's
        # Units of the encoder's hidden ReLU layers, first to last; the decoder's are the same,
        # reversed.
        hidden_sizes: list[int] = [512, 256],  # noqa: B006  (a config default, never mutated)
        latent_dim: int = 16,  # dimensions of the Gaussian latent space
        *,
        rngs: nnx.Rngs,
    ):
        hparams.positive(
            "vae", input_shape=input_shape, hidden_sizes=hidden_sizes, latent_dim=latent_dim
        )
        pixels = math.prod(input_shape)
        self.encoder = MLPStack([pixels, *hidden_sizes], rngs=rngs)
        latent_axes = (split_by_fsdp(self.encoder.out_axis), None)
        self.mean = dense(hidden_sizes[-1], latent_dim, latent_axes, rngs=rngs)
        self.log_var = dense(hidden_sizes[-1], latent_dim, latent_axes, rngs=rngs)
        self.decoder = MLPStack([latent_dim, *reversed(hidden_sizes)], rngs=rngs)
        pixel_axes = (split_by_fsdp(self.decoder.out_axis), None)
        self.pixels = dense(hidden_sizes[0], pixels, pixel_axes, rngs=rngs)
        self.noise = rngs["noise"].fork()  # module-bound: carried and checkpointed in the state
        self.deterministic = False  # model.eval() sets it: the latent is the posterior mean
        self.latent_dim = latent_dim

    def decode(self, z: jax.Array) -> jax.Array:
        """Bernoulli logits of every pixel, flattened: batch x pixels."""
        return self.pixels(self.decoder(z), out_sharding=logical_spec("batch", None))

    def __call__(self, images: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(pixel logits, posterior mean, posterior log-variance)."""
        h = self.encoder(images.reshape(images.shape[0], -1))
        spec = logical_spec("batch", None)
        mean, log_var = self.mean(h, out_sharding=spec), self.log_var(h, out_sharding=spec)
        if self.deterministic:
            z = mean
        else:
            noise = jax.random.normal(self.noise(), mean.shape, out_sharding=spec)
            z = mean + jnp.exp(0.5 * log_var) * noise
        return self.decode(z), mean, log_var
