"""Training a small class-conditional ε-prediction teacher (the embedded demo's diffusion model).

DDPM's simplified objective (Ho et al. 2020, eq. 14): ``E‖ε − ε_θ(√ᾱ_t·x0 + √(1 − ᾱ_t)·ε, t, c)‖²``
with t uniform over the T training timesteps and the schedule's ᾱ (tdd.md §2). Labels are replaced by
the empty label with probability ``p_uncond`` so the same network also predicts the unconditional ε
that classifier-free guidance needs (Ho & Salimans 2022, Sec. 3.2).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from runtime.metrics import ProgressBar
from tdd_jax.models.diffusers_io import abstract_module
from tdd_jax.sampler import module_eps_fn
from tdd_jax.schedules import add_noise


def init_module(constructor: Callable[[nnx.Rngs | None], nnx.Module], seed: int = 0) -> nnx.Module:
    """Builds ``constructor`` abstractly and draws its weights with NumPy (no per-shape compilation).

    Kernels (…, fan_in, out) ~ N(0, 1/fan_in) (LeCun normal), embeddings ~ N(0, 0.02²), norm scales 1, biases 0.
    """
    graphdef, state = abstract_module(constructor)
    rng = np.random.default_rng(seed)

    def draw(path, variable):
        shape, leaf = variable.get_value().shape, str(path[-1])
        if leaf == "kernel":
            value = rng.normal(size=shape) / math.sqrt(math.prod(shape[:-1]))
        elif leaf == "embedding":
            value = 0.02 * rng.normal(size=shape)
        else:
            value = np.ones(shape) if leaf == "scale" else np.zeros(shape)
        return variable.replace(jnp.asarray(value, jnp.float32))

    flat = [(path, draw(path, v)) for path, v in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


class ConditionalDenoiser(nnx.Module):
    """A UNet (``tdd_jax.sampler.EpsModel``) with a label encoder: ``model(x, t, labels) -> ε``."""

    def __init__(self, unet: nnx.Module, encoder: nnx.Module):
        self.unet = unet
        self.encoder = encoder

    def __call__(self, x: jax.Array, t: jax.Array, labels: jax.Array) -> jax.Array:
        return module_eps_fn(self.unet)(x, t, self.encoder(labels))


def denoising_loss(model: ConditionalDenoiser, x0: jax.Array, labels: jax.Array, key: jax.Array,
                   alphas_cumprod: jax.Array, p_uncond: float, empty_label: int) -> jax.Array:
    """DDPM's ε-MSE with label dropout (module docstring)."""
    k_t, k_noise, k_drop = jax.random.split(key, 3)
    b = x0.shape[0]
    t = jax.random.randint(k_t, (b,), 0, alphas_cumprod.shape[0])
    noise = jax.random.normal(k_noise, x0.shape, x0.dtype)
    labels = jnp.where(jax.random.uniform(k_drop, (b,)) < p_uncond, empty_label, labels)
    eps = model(add_noise(x0, noise, alphas_cumprod[t]), t, labels)
    return jnp.mean((eps - noise) ** 2)


def train_denoiser(model: ConditionalDenoiser, x0: np.ndarray, labels: np.ndarray, alphas_cumprod: jax.Array, *,
                   steps: int, batch_size: int, learning_rate: float, p_uncond: float, empty_label: int,
                   seed: int = 0) -> tuple[ConditionalDenoiser, float]:
    """AdamW (learning rate cosine-decayed to 5% over ``steps``) with gradient clipping 1.0 on random batches.

    Returns the model and its last loss.
    """
    if steps < 1 or batch_size < 1:
        raise ValueError(f"teacher steps and batch_size must be positive, got {steps}, {batch_size}")
    graphdef, params = nnx.split(model)
    schedule = optax.cosine_decay_schedule(learning_rate, steps, alpha=0.05)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.0))
    data_x, data_y = jnp.asarray(x0), jnp.asarray(labels)

    @jax.jit
    def step(params, opt_state, key):
        k_batch, k_loss = jax.random.split(key)
        index = jax.random.randint(k_batch, (batch_size,), 0, data_y.shape[0])
        loss_fn = lambda p: denoising_loss(nnx.merge(graphdef, p), data_x[index], data_y[index], k_loss,
                                           alphas_cumprod, p_uncond, empty_label)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = tx.init(params)
    loss = jnp.zeros(())
    with ProgressBar(steps, "teacher") as bar:
        for i, key in enumerate(jax.random.split(jax.random.key(seed), steps)):
            params, opt_state, loss = step(params, opt_state, key)
            if (i + 1) % 50 == 0 or i + 1 == steps:
                bar.update(i + 1, {"loss": float(loss)})
    return nnx.merge(graphdef, params), float(loss)
