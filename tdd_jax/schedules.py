"""Noise schedule and timestep grids of Target-Driven Distillation (TDD, arXiv 2409.01347).

Everything here follows ``docs/reference/tdd.md`` starpo.md §2-3 and §11:

* the DDPM variance-preserving schedule ``ᾱ_t = Π_{i≤t}(1 − β_i)``, ``α_t = sqrt(ᾱ_t)``,
  ``σ_t = sqrt(1 − ᾱ_t)``, read from a diffusers scheduler config;
* the teacher's DDIM grid ``[1..N_ddim]·k − 1`` with skip ``k = T // N_ddim``;
* the equidistant K-step inference schedules, the non-equidistant "special jump" ones, and
  the merged candidate target set used by the TDD target selector;
* the moves along the schedule shared by distillation and sampling: the ε→x̂0 conversion,
  the DDIM / consistency jump ``f(x_t, t, s) = α_s·x̂0 + σ_s·ε`` and forward re-noising.

Integer timestep tables are built on the host in NumPy (they are static); ᾱ is float32.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Non-equidistant schedules of TDDScheduler(special_jump=True); defined only for the 250-point grid.
SPECIAL_JUMP_SCHEDULES = {
    5: (999, 875, 751, 499, 251),
    6: (999, 875, 751, 627, 499, 251),
    7: (999, 875, 751, 627, 499, 375, 251),
}
SPECIAL_JUMP_GRID_SIZE = 250


class TDDSchedule(NamedTuple):
    """The static tables one distillation run needs.

    Attributes:
      alphas_cumprod: ᾱ_t for t = 0..T−1, float32 (T,).
      ddim_timesteps: the teacher's grid ``[1..N_ddim]·k − 1``, int32 (N_ddim,).
      skip: k, the size of one teacher step (a Python int).
      candidates: merged target set, ascending, starting at 0, int32 (M,).
    """

    alphas_cumprod: jax.Array
    ddim_timesteps: jax.Array
    skip: int
    candidates: jax.Array


def betas_for_schedule(beta_schedule: str, beta_start: float, beta_end: float,
                       num_train_timesteps: int) -> np.ndarray:
    """β_1..β_T of the DDPM ``linear`` or ``scaled_linear`` schedule (Ho et al. 2020; LDM).

    ``scaled_linear``: ``β = linspace(sqrt(β_start), sqrt(β_end), T)²`` (tdd.md §2).
    """
    if num_train_timesteps < 2:
        raise ValueError(f"num_train_timesteps must be at least 2, got {num_train_timesteps}")
    if not 0.0 < beta_start <= beta_end < 1.0:
        raise ValueError(f"need 0 < beta_start <= beta_end < 1, got beta_start={beta_start}, beta_end={beta_end}")
    if beta_schedule == "scaled_linear":
        return np.linspace(beta_start ** 0.5, beta_end ** 0.5, num_train_timesteps, dtype=np.float64) ** 2
    if beta_schedule == "linear":
        return np.linspace(beta_start, beta_end, num_train_timesteps, dtype=np.float64)
    raise ValueError(f"beta_schedule must be 'scaled_linear' or 'linear', got {beta_schedule!r}")


def _read_scheduler_config(config: Mapping[str, Any] | str | os.PathLike) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        return config
    path = os.fspath(config)
    if os.path.isdir(path):
        for candidate in ("scheduler_config.json", os.path.join("scheduler", "scheduler_config.json")):
            if os.path.isfile(os.path.join(path, candidate)):
                path = os.path.join(path, candidate)
                break
        else:
            raise FileNotFoundError(f"no scheduler_config.json in {path!r} or its scheduler/ folder")
    with open(path) as f:
        return json.load(f)


def alphas_cumprod_from_config(config: Mapping[str, Any] | str | os.PathLike) -> jax.Array:
    """ᾱ_t (float32, shape (T,)) from a diffusers scheduler config.

    Args:
      config: the config as a dict, a ``scheduler_config.json`` path, or a diffusers folder
        (its ``scheduler/`` subfolder is searched). Missing keys take diffusers' defaults.
    """
    config = _read_scheduler_config(config)
    prediction_type = config.get("prediction_type", "epsilon")
    if prediction_type != "epsilon":
        raise ValueError(f"prediction_type must be 'epsilon' (TDD distils an ε-prediction teacher), "
                         f"got {prediction_type!r}")
    if config.get("rescale_betas_zero_snr", False):
        raise ValueError("rescale_betas_zero_snr=True is not supported: TDD's schedule has non-zero terminal SNR")
    num_train_timesteps = int(config.get("num_train_timesteps", 1000))
    if config.get("trained_betas") is not None:
        betas = np.asarray(config["trained_betas"], np.float64)
        if betas.ndim != 1 or np.any(betas <= 0) or np.any(betas >= 1):
            raise ValueError("trained_betas must be a 1-D list of values in (0, 1)")
    else:
        betas = betas_for_schedule(config.get("beta_schedule", "linear"), float(config.get("beta_start", 0.0001)),
                                   float(config.get("beta_end", 0.02)), num_train_timesteps)
    return jnp.asarray(np.cumprod(1.0 - betas), jnp.float32)


def ddim_timesteps(num_train_timesteps: int, num_ddim_timesteps: int) -> tuple[np.ndarray, int]:
    """The teacher's DDIM grid ``[1, 2, …, N_ddim]·k − 1`` and its skip ``k = T // N_ddim`` (tdd.md §3.1)."""
    if not 1 <= num_ddim_timesteps <= num_train_timesteps:
        raise ValueError(f"num_ddim_timesteps must be in [1, {num_train_timesteps}], got {num_ddim_timesteps}")
    skip = num_train_timesteps // num_ddim_timesteps
    return np.arange(1, num_ddim_timesteps + 1, dtype=np.int64) * skip - 1, skip


def equidistant_schedule(grid: np.ndarray, num_steps: int) -> np.ndarray:
    """K-step schedule, descending: positions ``floor(linspace(0, len, K, endpoint=False))`` of the reversed grid."""
    grid = np.asarray(grid)
    if not 1 <= num_steps <= len(grid):
        raise ValueError(f"num_steps must be in [1, {len(grid)}] for a {len(grid)}-point grid, got {num_steps}")
    positions = np.floor(np.linspace(0, len(grid), num_steps, endpoint=False)).astype(np.int64)
    return grid[::-1][positions]


def special_jump_schedule(grid: np.ndarray, num_steps: int) -> np.ndarray:
    """The non-equidistant schedules of TDDScheduler(special_jump=True) (tdd.md §11), 250-point grid only."""
    grid = np.asarray(grid)
    if len(grid) != SPECIAL_JUMP_GRID_SIZE or grid[-1] != 999:
        raise ValueError(f"special_jump needs num_ddim_timesteps={SPECIAL_JUMP_GRID_SIZE} over 1000 train "
                         f"timesteps, got a {len(grid)}-point grid ending at {grid[-1]}")
    if num_steps not in SPECIAL_JUMP_SCHEDULES:
        raise ValueError(f"special_jump defines num_steps {sorted(SPECIAL_JUMP_SCHEDULES)}, got {num_steps}")
    return np.asarray(SPECIAL_JUMP_SCHEDULES[num_steps], np.int64)


def inference_schedule(grid: np.ndarray, num_steps: int, special_jump: bool = False) -> np.ndarray:
    """Descending sampling timesteps for ``num_steps`` steps on ``grid``."""
    return special_jump_schedule(grid, num_steps) if special_jump else equidistant_schedule(grid, num_steps)


def merged_candidates(grid: np.ndarray, k_min: int, k_max: int) -> np.ndarray:
    """Candidate target set: union of the K = k_min..k_max schedules, ascending, 0 prepended, largest dropped.

    This is ``set_timesteps_s`` of the reference (tdd.md §3.3).
    """
    if not 1 <= k_min <= k_max:
        raise ValueError(f"need 1 <= num_inference_steps_min <= num_inference_steps_max, got {k_min}, {k_max}")
    union = np.unique(np.concatenate([equidistant_schedule(grid, k) for k in range(k_min, k_max + 1)]))
    return np.concatenate([[0], union])[:-1]


def make_tdd_schedule(alphas_cumprod: jax.Array, num_ddim_timesteps: int = 250,
                      k_min: int = 4, k_max: int = 8) -> TDDSchedule:
    """Builds the static tables of one distillation run from ᾱ."""
    grid, skip = ddim_timesteps(int(alphas_cumprod.shape[0]), num_ddim_timesteps)
    return TDDSchedule(jnp.asarray(alphas_cumprod, jnp.float32), jnp.asarray(grid, jnp.int32), skip,
                       jnp.asarray(merged_candidates(grid, k_min, k_max), jnp.int32))


def sampling_targets(timesteps: np.ndarray, eta: float) -> np.ndarray:
    """Intermediate DDIM targets ``s_{i+1} = floor((1 − eta)·t_{i+1})`` in float64 (tdd.md §11, step 1)."""
    if not 0.0 <= eta < 1.0:
        raise ValueError(f"eta must be in [0, 1), got {eta}")
    return np.floor((1.0 - eta) * np.asarray(timesteps[1:], np.float64)).astype(np.int64)


def _expand(a: jax.Array, x: jax.Array) -> jax.Array:
    """Broadcasts a per-sample (B,) or scalar coefficient over the trailing axes of ``x``."""
    a = jnp.asarray(a, x.dtype)
    return a.reshape(a.shape + (1,) * (x.ndim - a.ndim))


def predicted_origin(x_t: jax.Array, eps: jax.Array, alpha_bar_t: jax.Array) -> jax.Array:
    """x̂0 = (x_t − σ_t·ε) / α_t (ε-prediction; tdd.md §4 step 7)."""
    return (x_t - _expand(jnp.sqrt(1.0 - alpha_bar_t), x_t) * eps) / _expand(jnp.sqrt(alpha_bar_t), x_t)


def implied_noise(x_t: jax.Array, x0: jax.Array, alpha_bar_t: jax.Array) -> jax.Array:
    """ε = (x_t − α_t·x̂0) / σ_t, the noise consistent with x_t and a (possibly clipped) x̂0."""
    return (x_t - _expand(jnp.sqrt(alpha_bar_t), x_t) * x0) / _expand(jnp.sqrt(1.0 - alpha_bar_t), x_t)


def ddim_jump(x0: jax.Array, eps: jax.Array, alpha_bar_s: jax.Array) -> jax.Array:
    """DDIM (η = 0) / first-order DPM-Solver++ move to s: ``α_s·x̂0 + σ_s·ε`` (tdd.md §4 steps 7, 9)."""
    return _expand(jnp.sqrt(alpha_bar_s), x0) * x0 + _expand(jnp.sqrt(1.0 - alpha_bar_s), x0) * eps


def consistency_jump(x_t: jax.Array, eps: jax.Array, alpha_bar_t: jax.Array, alpha_bar_s: jax.Array) -> jax.Array:
    """The TDD consistency function ``f(x_t, t, s) = α_s·x̂0(x_t, ε) + σ_s·ε`` (tdd.md §5); f(x, t, t) = x."""
    return ddim_jump(predicted_origin(x_t, eps, alpha_bar_t), eps, alpha_bar_s)


def renoise(x_s: jax.Array, noise: jax.Array, alpha_bar_s: jax.Array, alpha_bar_t: jax.Array) -> jax.Array:
    """Noising from s to a later t: ``sqrt(ᾱ_t/ᾱ_s)·x_s + sqrt(1 − ᾱ_t/ᾱ_s)·z`` (tdd.md §11, step 4)."""
    ratio = alpha_bar_t / alpha_bar_s
    return _expand(jnp.sqrt(ratio), x_s) * x_s + _expand(jnp.sqrt(1.0 - ratio), x_s) * noise


def add_noise(x0: jax.Array, noise: jax.Array, alpha_bar_t: jax.Array) -> jax.Array:
    """q(x_t | x0): ``sqrt(ᾱ_t)·x0 + sqrt(1 − ᾱ_t)·ε`` (tdd.md §4 step 5)."""
    return ddim_jump(x0, noise, alpha_bar_t)
