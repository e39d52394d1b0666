"""Target-timestep selectors: where the student's consistency jump lands (tdd.md §6).

A selector maps a PRNG key and the teacher's end points ``t_n`` (B,) to targets ``s`` (B,)
with ``0 ≤ s ≤ t_n``. Three are registered in ``SELECTORS`` and chosen by name:

* ``tdd`` (default) — the reference's ``select_s``: τ uniform over the candidates in the window
  ``[max(τ_max − 260, 0), τ_max]``, τ_max the largest candidate ≤ t_n, then the stochastic offset
  ``s = floor((1 − u·s_ratio)·τ)``, u ~ U[0, 1).
* ``lcm`` — s = 0 (consistency models map straight to the origin).
* ``tcd`` — s uniform over {0} ∪ {DDIM grid points ≤ t_n}; no offset (TCD uses γ only at inference).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from runtime.registry import Registry
from tdd_jax.schedules import TDDSchedule

TDD_WINDOW = 260  # hard-coded width of the reference's candidate window

Selector = Callable[[jax.Array, jax.Array], jax.Array]


def _uniform_masked_choice(key: jax.Array, values: jax.Array, mask: jax.Array) -> jax.Array:
    """One value per row, uniform over ``values[mask[b]]`` (every row of ``mask`` must hold a True)."""
    logits = jnp.where(mask, 0.0, -jnp.inf)
    return values[jax.random.categorical(key, logits, axis=-1)]


def select_target_timestep(key: jax.Array, t_n: jax.Array, candidates: jax.Array, s_ratio: float = 0.3,
                           window: int = TDD_WINDOW) -> jax.Array:
    """TDD target selection (``select_s``, tdd.md §6), vectorised over the batch.

    Args:
      key: PRNG key.
      t_n: teacher end points, int (B,).
      candidates: the merged target set, ascending with ``candidates[0] = 0`` (M,).
      s_ratio: largest relative offset γ_max of the stochastic offset.
      window: width below τ_max admitted as candidates.

    Returns:
      s, int32 (B,), with ``floor((1 − s_ratio)·τ) ≤ s ≤ τ ≤ t_n``.
    """
    choice_key, offset_key = jax.random.split(key)
    t_n = jnp.asarray(t_n, jnp.int32)[:, None]
    candidates = jnp.asarray(candidates, jnp.int32)
    tau_max = jnp.max(jnp.where(candidates <= t_n, candidates, 0), axis=-1, keepdims=True)
    in_window = (candidates >= jnp.maximum(tau_max - window, 0)) & (candidates <= tau_max)
    tau = _uniform_masked_choice(choice_key, candidates, in_window)
    u = jax.random.uniform(offset_key, tau.shape, jnp.float32)
    return jnp.floor((1.0 - u * s_ratio) * tau.astype(jnp.float32)).astype(jnp.int32)


def select_origin(key: jax.Array, t_n: jax.Array) -> jax.Array:
    """LCM: every target is s = 0."""
    del key
    return jnp.zeros(jnp.shape(t_n), jnp.int32)


def select_grid_timestep(key: jax.Array, t_n: jax.Array, grid: jax.Array) -> jax.Array:
    """TCD: s uniform over {0} ∪ {g ∈ grid : g ≤ t_n}."""
    t_n = jnp.asarray(t_n, jnp.int32)[:, None]
    values = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.asarray(grid, jnp.int32)])
    return _uniform_masked_choice(key, values, values <= t_n)


# ``build(schedule, s_ratio) -> (key, t_n) -> s``: one target-timestep selector per ``DistillConfig.selector``.
SELECTORS: Registry[Callable[[TDDSchedule, float], Selector]] = Registry("target selector", "DistillConfig.selector")
SELECTORS.register("tdd", lambda schedule, s_ratio: functools.partial(
    select_target_timestep, candidates=schedule.candidates, s_ratio=s_ratio))
SELECTORS.register("tcd", lambda schedule, s_ratio: functools.partial(select_grid_timestep,
                                                                      grid=schedule.ddim_timesteps))
SELECTORS.register("lcm", lambda schedule, s_ratio: select_origin)


def make_selector(name: str, schedule: TDDSchedule, s_ratio: float = 0.3) -> Selector:
    """The selector ``(key, t_n) -> s`` registered as ``name`` in ``SELECTORS``, on ``schedule``."""
    if not 0.0 <= s_ratio < 1.0:
        raise ValueError(f"s_ratio must be in [0, 1), got {s_ratio}")
    return SELECTORS.get(name, "selector")(schedule, s_ratio)
