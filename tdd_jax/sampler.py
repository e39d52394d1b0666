"""TDD few-step sampling (``TDDScheduler``, tdd.md §11) for any ε-prediction model.

Each step i, from t_i with model output ε:

1. ``x̂0 = (x − σ_t·ε)/α_t``, dynamically thresholded on steps ``0..t_l`` (tdd.md §11, x0 clipping);
   as in DPM-Solver++, a thresholded x̂0 replaces ε by the noise it implies, ``(x − α_t·x̂0)/σ_t``;
2. DDIM / first-order DPM-Solver++ jump to ``s_{i+1} = floor((1 − eta)·t_{i+1})``:
   ``x_s = α_s·x̂0 + σ_s·ε`` (σ_s = 0 on the last step, which returns x̂0);
3. re-noising forward to t_{i+1}: ``sqrt(ᾱ_{t_{i+1}}/ᾱ_s)·x_s + sqrt(1 − ᾱ_{t_{i+1}}/ᾱ_s)·z``.

With eta = 0 this is plain DDIM on the same timesteps. Guidance is ordinary CFG with scale g on
the distilled model: ``ε = ε_u + g·(ε_c − ε_u)``, applied only when g > 1 (as diffusers' pipelines).

The model is any callable ``eps_fn(x, t, cond) -> ε`` with x (B, H, W, C), t int (B,) and cond a
``Conditioning`` (SD1.5: context only; SDXL: plus pooled ``text_embeds`` and ``time_ids``);
``module_eps_fn`` adapts an NNX module.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tdd_jax.schedules import (ddim_jump, ddim_timesteps, implied_noise, inference_schedule, predicted_origin,
                               renoise, sampling_targets)

EpsFn = Callable[[jax.Array, jax.Array, Any], jax.Array]


class Conditioning(NamedTuple):
    """Text conditioning in diffusers' terms.

    Attributes:
      context: ``encoder_hidden_states`` (B, L, D).
      added: ``added_cond_kwargs`` for SDXL, e.g. ``{"text_embeds": (B, P), "time_ids": (B, 6)}``; None for SD1.5.
    """

    context: jax.Array
    added: dict[str, jax.Array] | None = None


def replace_conditioning(cond: Conditioning, uncond: Conditioning, mask: jax.Array) -> Conditioning:
    """Rows where ``mask`` is set take ``uncond`` (batch 1 or B); keys absent from ``uncond.added`` stay."""
    def pick(c, u):
        return jnp.where(mask.reshape((-1,) + (1,) * (c.ndim - 1)), u.astype(c.dtype), c)

    added = cond.added
    if added is not None:
        added = {k: pick(v, uncond.added[k]) if uncond.added and k in uncond.added else v for k, v in added.items()}
    return Conditioning(pick(cond.context, uncond.context), added)


def broadcast_conditioning(uncond: Conditioning, cond: Conditioning) -> Conditioning:
    """``uncond`` on every row of ``cond``, keeping ``cond``'s added keys that ``uncond`` lacks (e.g. time_ids)."""
    return replace_conditioning(cond, uncond, jnp.ones((cond.context.shape[0],), bool))


class EpsModel(Protocol):
    """The ε-prediction module protocol (``tdd_jax.models.unet.UNet2DConditionModel`` follows it).

    ``model(x, t, context, added_cond=None, *, lora_scale=1.0) -> ε``: x and ε are NHWC latents, t an
    int (B,) timestep; LoRA adapters are ``nnx.LoRAParam`` variables, skipped when ``lora_scale == 0``.
    """

    def __call__(self, x: jax.Array, t: jax.Array, context: jax.Array,
                 added_cond: dict[str, jax.Array] | None = None, *, lora_scale: float = 1.0) -> jax.Array: ...


def module_eps_fn(model: EpsModel, lora_scale: float = 1.0) -> EpsFn:
    """``eps_fn(x, t, cond)`` of a module following ``EpsModel``, with cond a ``Conditioning``."""
    return lambda x, t, cond: model(x, t, cond.context, cond.added, lora_scale=lora_scale)


def classifier_free_guidance(eps_cond: jax.Array, eps_uncond: jax.Array, scale: jax.Array | float) -> jax.Array:
    """CFG (Ho & Salimans 2022): ``ε_u + g·(ε_c − ε_u)``; LCM's form with w is ``g = 1 + w``."""
    return eps_uncond + scale * (eps_cond - eps_uncond)


def guided_eps(eps_fn: EpsFn, x: jax.Array, t: jax.Array, cond: Any, uncond: Any,
               scale: jax.Array | float) -> jax.Array:
    """CFG with the conditional and unconditional passes batched together (2B rows, one call)."""
    both = jax.tree.map(lambda c, u: jnp.concatenate([c, u]), cond, uncond)
    eps_c, eps_u = jnp.split(eps_fn(jnp.concatenate([x, x]), jnp.concatenate([t, t]), both), 2)
    return classifier_free_guidance(eps_c, eps_u, scale)


def dynamic_threshold(x0: jax.Array, ratio: float = 0.995, max_value: float = 1.0) -> jax.Array:
    """Imagen dynamic thresholding as diffusers applies it: ``q = clip(quantile(|x̂0|, ratio), 1, max)``,
    ``x̂0 ← clip(x̂0, −q, q)/q`` per sample. With ``max_value = 1`` it is a hard clip to [−1, 1]."""
    q = jnp.quantile(jnp.abs(x0).reshape(x0.shape[0], -1), ratio, axis=1)
    q = jnp.clip(q, 1.0, max_value).reshape((-1,) + (1,) * (x0.ndim - 1))
    return jnp.clip(x0, -q, q) / q


class SamplingPlan(NamedTuple):
    """Per-step tables of one TDD sampling run (static, built on the host).

    Attributes:
      timesteps: t_i, int32 (N,).
      alpha_bar_t: ᾱ at t_i (N,).
      alpha_bar_s: ᾱ at the DDIM target s_{i+1}; 1 (σ = 0, i.e. x̂0) on the last step (N,).
      alpha_bar_next: ᾱ at t_{i+1}, the re-noising end point; 1 on the last step (N,).
      threshold: whether x̂0 is thresholded on step i, bool (N,).
    """

    timesteps: jax.Array
    alpha_bar_t: jax.Array
    alpha_bar_s: jax.Array
    alpha_bar_next: jax.Array
    threshold: jax.Array


def make_sampling_plan(alphas_cumprod: jax.Array, num_steps: int = 4, eta: float = 0.2,
                       num_ddim_timesteps: int = 250, special_jump: bool = False, t_l: int = -1) -> SamplingPlan:
    """Plans ``num_steps`` TDD steps; x̂0 is thresholded on steps ``0..t_l`` (−1: never)."""
    if t_l < -1:
        raise ValueError(f"t_l must be -1 (no thresholding) or a step index, got {t_l}")
    abar = np.asarray(alphas_cumprod, np.float64)
    grid, _ = ddim_timesteps(len(abar), num_ddim_timesteps)
    timesteps = inference_schedule(grid, num_steps, special_jump)
    targets = sampling_targets(timesteps, eta)
    return SamplingPlan(
        timesteps=jnp.asarray(timesteps, jnp.int32),
        alpha_bar_t=jnp.asarray(abar[timesteps], jnp.float32),
        alpha_bar_s=jnp.asarray(np.append(abar[targets], 1.0), jnp.float32),
        alpha_bar_next=jnp.asarray(np.append(abar[timesteps[1:]], 1.0), jnp.float32),
        threshold=jnp.asarray(np.arange(len(timesteps)) <= t_l),
    )


def tdd_sample(eps_fn: EpsFn, x_T: jax.Array, cond: Conditioning, plan: SamplingPlan, key: jax.Array,
               uncond: Conditioning | None = None, guidance_scale: jax.Array | float = 1.0,
               sample_max_value: float = 1.0) -> jax.Array:
    """Runs the TDD sampler from x_T ~ N(0, I) and returns x̂0 (latents).

    Args:
      eps_fn: ε-prediction ``eps_fn(x, t, cond)``.
      x_T: initial noise (B, H, W, C).
      cond: ``Conditioning``, batch-leading.
      plan: from ``make_sampling_plan``.
      key: PRNG key; step i re-noises with ``normal(split(key, N)[i])``.
      uncond: unconditional ``Conditioning`` for CFG (batch 1 or B; its ``added`` may hold only the keys it
        replaces, e.g. ``text_embeds``); None: no CFG.
      guidance_scale: CFG scale g (used only with ``uncond``); a Python number ≤ 1 turns CFG off, as
        diffusers' ``do_classifier_free_guidance`` (``guidance_scale > 1``).
      sample_max_value: upper bound of the dynamic-thresholding quantile.
    """
    if isinstance(guidance_scale, (int, float)):
        if guidance_scale <= 1.0:
            uncond = None  # as diffusers' pipelines: CFG only when guidance_scale > 1
        elif uncond is None:
            raise ValueError("guidance_scale above 1 needs the unconditional conditioning `uncond`")
    if sample_max_value < 1.0:
        raise ValueError(f"sample_max_value must be >= 1 (1 = hard clip to [-1, 1]), got {sample_max_value}")

    def eps_at(x, t):
        if uncond is None:
            return eps_fn(x, t, cond)
        return guided_eps(eps_fn, x, t, cond, broadcast_conditioning(uncond, cond), guidance_scale)

    def step(x, inputs):
        t, abar_t, abar_s, abar_next, threshold, step_key = inputs
        eps = eps_at(x, jnp.full((x.shape[0],), t, jnp.int32)).astype(x.dtype)
        x0 = predicted_origin(x, eps, abar_t)
        clipped = dynamic_threshold(x0, max_value=sample_max_value)
        x0, eps = jnp.where(threshold, clipped, x0), jnp.where(threshold, implied_noise(x, clipped, abar_t), eps)
        x_s = ddim_jump(x0, eps, abar_s)
        return renoise(x_s, jax.random.normal(step_key, x.shape, x.dtype), abar_s, abar_next), None

    keys = jax.random.split(key, plan.timesteps.shape[0])
    x0, _ = jax.lax.scan(step, x_T, (*plan, keys))
    return x0


@functools.partial(jax.jit, static_argnums=(0, 6))
def sample_module(graphdef, state, x_T, cond, uncond, plan, guidance, key):
    """``tdd_sample`` of the module ``graphdef``/``state`` (compiled once per graph, step count and guidance)."""
    return tdd_sample(module_eps_fn(nnx.merge(graphdef, state)), x_T, cond, plan, key, uncond, guidance)
