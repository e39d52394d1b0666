"""Actor and critic losses of StarPO (starpo.md §10): decoupled/dual clip, entropy, KL, value clipping.

Inputs are what an actor or critic step holds: ``(B, T)`` log-probs of the trained
tokens under the current, old (recomputed) and reference policies, advantages,
the loss mask and per-token entropies. Each loss returns ``(loss, metrics)`` with
RAGEN/verl's metric names. Policy losses, critic losses, aggregation modes and KL estimators are
registries (``runtime.registry``) the config names them from.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from runtime.registry import Registry
from starpo_jax.masked import MEAN_EPS, masked_mean, masked_sum


class LossOutput(NamedTuple):
    """A scalar loss to differentiate and the metrics logged with it."""

    loss: jax.Array
    metrics: dict[str, jax.Array]


class LossAggregation(NamedTuple):
    """A loss aggregation mode: ``agg = Σ_rows sequence_loss(loss_mat, mask) / normalizer(mask)``."""

    sequence_loss: Callable[[jax.Array, jax.Array], jax.Array]
    normalizer: Callable[[jax.Array], jax.Array]


LOSS_AGG_MODES: Registry[LossAggregation] = Registry("loss aggregation mode", "actor_rollout_ref.actor.loss_agg_mode")
_token_sums = lambda loss_mat, mask: masked_sum(loss_mat, mask, axis=-1)
_num_sequences = lambda mask: jnp.maximum(jnp.sum(jnp.any(mask > 0, axis=-1)), 1).astype(jnp.float32)
LOSS_AGG_MODES.register("token-mean", LossAggregation(_token_sums, lambda mask: jnp.sum(mask) + MEAN_EPS))
LOSS_AGG_MODES.register("seq-mean-token-mean", LossAggregation(
    lambda loss_mat, mask: _token_sums(loss_mat, mask) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0), _num_sequences))
LOSS_AGG_MODES.register("seq-mean-token-sum", LossAggregation(_token_sums, _num_sequences))
LOSS_AGG_MODES.register("seq-mean-token-sum-norm", LossAggregation(
    _token_sums, lambda mask: jnp.asarray(mask.shape[-1], jnp.float32)))


def loss_normalizer(loss_mask: jax.Array, loss_agg_mode: str) -> jax.Array:
    """What ``aggregate_loss`` divides by for this batch under ``loss_agg_mode``.

    ``token-mean``: the number of masked tokens (+1e-8, verl ``masked_mean``); ``seq-mean-*``:
    the number of sequences with at least one masked token; ``seq-mean-token-sum-norm``: ``T``.
    Computed once over a whole mini-batch and passed to each micro-batch's loss, it makes the
    sum of the micro-batch losses equal the mini-batch loss (starpo.md §22.5).
    """
    mode = LOSS_AGG_MODES.get(loss_agg_mode, "loss_agg_mode")
    return mode.normalizer(jnp.asarray(loss_mask, jnp.float32))


def aggregate_loss(loss_mat: jax.Array, loss_mask: jax.Array, loss_agg_mode: str,
                   normalizer: jax.Array | None = None) -> jax.Array:
    """Reduces a ``(B, T)`` per-token loss to a scalar (verl ``agg_loss``, starpo.md §22.5).

    ``token-mean``: masked mean over all tokens; ``seq-mean-token-mean``: mean over sequences of
    each sequence's masked token mean (eq. 4); ``seq-mean-token-sum``: mean over sequences of the
    masked token sum; ``seq-mean-token-sum-norm``: total masked sum divided by ``T``. Rows whose
    mask is all zero are padding and do not count as sequences. ``normalizer`` replaces this
    batch's ``loss_normalizer`` (pass the mini-batch's to accumulate micro-batches by summing).
    """
    mode = LOSS_AGG_MODES.get(loss_agg_mode, "loss_agg_mode")
    loss_mask = jnp.asarray(loss_mask, jnp.float32)
    if normalizer is None:
        normalizer = mode.normalizer(loss_mask)
    return jnp.sum(mode.sequence_loss(loss_mat, loss_mask)) / normalizer


# ``fn(log_probs, old_log_probs, advantages, loss_mask, clip_ratio_low, clip_ratio_high, clip_ratio_c,
# loss_agg_mode, normalizer) -> LossOutput`` (``decoupled_clip_loss``'s signature), by ``policy_loss.loss_mode``.
POLICY_LOSSES: Registry[Callable[..., LossOutput]] = Registry(
    "policy loss", "actor_rollout_ref.actor.policy_loss.loss_mode")


@POLICY_LOSSES.register("vanilla")
def decoupled_clip_loss(log_probs: jax.Array, old_log_probs: jax.Array, advantages: jax.Array,
                        loss_mask: jax.Array, clip_ratio_low: float, clip_ratio_high: float,
                        clip_ratio_c: float | None = 3.0, loss_agg_mode: str = "seq-mean-token-mean",
                        normalizer: jax.Array | None = None) -> LossOutput:
    """PPO clipped surrogate, decoupled ε_low/ε_high, dual clip (starpo.md §10, verl ``compute_policy_loss``).

    ``ρ = exp(logp − old_logp)``, ``L = max(−A·ρ, −A·clip(ρ, 1 − ε_low, 1 + ε_high))``; with dual
    clip, tokens with ``A < 0`` use ``min(L, −A·c)``. Metrics: ``actor/pg_loss``,
    ``actor/pg_clipfrac`` (fraction where the clipped term is larger), ``actor/pg_clipfrac_lower``
    (fraction with ``A < 0`` bounded by ``−A·c``; 0 without dual clip) and ``actor/ppo_kl``
    (masked mean of ``old_logp − logp``). ``normalizer`` is that of ``aggregate_loss``.
    """
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"actor_rollout_ref.actor.clip_ratio_c must be > 1.0 or None, got {clip_ratio_c}")
    mask = jnp.asarray(loss_mask, jnp.float32)
    log_ratio = jnp.asarray(log_probs, jnp.float32) - jnp.asarray(old_log_probs, jnp.float32)
    advantages = jnp.asarray(advantages, jnp.float32)
    ratio = jnp.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    losses = jnp.maximum(unclipped, clipped)
    clipfrac = masked_mean((clipped > unclipped).astype(jnp.float32), mask)
    clipfrac_lower = jnp.zeros((), jnp.float32)
    if clip_ratio_c is not None:
        lower_bound = -advantages * clip_ratio_c
        negative = advantages < 0
        clipfrac_lower = masked_mean(((losses > lower_bound) & negative).astype(jnp.float32), mask)
        losses = jnp.where(negative, jnp.minimum(losses, lower_bound), losses)
    pg_loss = aggregate_loss(losses, mask, loss_agg_mode, normalizer)
    metrics = {"actor/pg_loss": pg_loss, "actor/pg_clipfrac": clipfrac,
               "actor/pg_clipfrac_lower": clipfrac_lower, "actor/ppo_kl": masked_mean(-log_ratio, mask)}
    return LossOutput(pg_loss, metrics)


def entropy_from_logits(logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """Per-token entropy ``H(softmax(z))`` of ``z = logits / T`` (verl ``entropy_from_logits``).

    ``H = logsumexp(z) − Σ softmax(z)·z``, computed in float32 over the last axis.
    """
    z = jnp.asarray(logits, jnp.float32) / temperature
    return jax.nn.logsumexp(z, axis=-1) - jnp.sum(jax.nn.softmax(z, axis=-1) * z, axis=-1)


KL_ESTIMATORS: Registry[Callable[[jax.Array], jax.Array]] = Registry(
    "KL estimator", "actor_rollout_ref.actor.kl_loss_type or algorithm.kl_penalty")


def _low_var_kl(diff: jax.Array) -> jax.Array:
    reverse = jnp.clip(-diff, -20.0, 20.0)
    return jnp.clip(jnp.exp(reverse) - reverse - 1.0, -10.0, 10.0)


for _names, _estimator in ((("kl", "k1"), lambda diff: diff), (("abs",), jnp.abs),
                           (("mse", "k2"), lambda diff: 0.5 * jnp.square(diff)), (("low_var_kl", "k3"), _low_var_kl)):
    for _name in _names:
        KL_ESTIMATORS.register(_name, _estimator)


def kl_penalty(log_probs: jax.Array, ref_log_probs: jax.Array, kl_type: str = "kl") -> jax.Array:
    """Per-token KL estimate between the policy and the reference (verl ``kl_penalty``).

    ``kl``/``k1``: ``logp − ref``; ``abs``: ``|logp − ref|``; ``mse``/``k2``: ``½(logp − ref)²``;
    ``low_var_kl``/``k3``: ``exp(d) − d − 1`` with ``d = clip(ref − logp, −20, 20)``, clamped to
    ``[−10, 10]`` (Schulman's low-variance estimator). ``KL_ESTIMATORS`` holds them by name.
    """
    estimator = KL_ESTIMATORS.get(kl_type)
    return estimator(jnp.asarray(log_probs, jnp.float32) - jnp.asarray(ref_log_probs, jnp.float32))


def actor_loss(log_probs: jax.Array, old_log_probs: jax.Array, advantages: jax.Array, loss_mask: jax.Array,
               entropy: jax.Array, ref_log_probs: jax.Array | None = None, *, clip_ratio_low: float,
               clip_ratio_high: float, clip_ratio_c: float | None, entropy_coeff: float, use_kl_loss: bool,
               kl_loss_coef: float, kl_loss_type: str = "kl", loss_agg_mode: str = "seq-mean-token-mean",
               normalizer: jax.Array | None = None, policy_loss: str = "vanilla") -> LossOutput:
    """StarPO policy objective (starpo.md §10): ``pg_loss − entropy_coeff·H + kl_loss_coef·KL(π, π_ref)``.

    The entropy and KL terms use the same aggregation as the policy-gradient term. Adds
    ``actor/entropy_loss`` (positive mean entropy) and, with the KL loss, ``actor/kl_loss`` and
    ``actor/kl_coef``. ``ref_log_probs`` is required only when ``use_kl_loss``; ``normalizer`` is
    that of ``aggregate_loss``. ``pg_loss`` is the registered ``POLICY_LOSSES[policy_loss]``, called
    with ``decoupled_clip_loss``'s arguments.
    """
    if use_kl_loss and ref_log_probs is None:
        raise ValueError("ref_log_probs is required when actor_rollout_ref.actor.use_kl_loss is True")
    pg_loss, metrics = POLICY_LOSSES.get(policy_loss)(log_probs, old_log_probs, advantages, loss_mask,
                                                      clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode,
                                                      normalizer)
    entropy_term = aggregate_loss(entropy, loss_mask, loss_agg_mode, normalizer)
    loss = pg_loss - entropy_coeff * entropy_term
    metrics = {**metrics, "actor/entropy_loss": entropy_term}
    if use_kl_loss:
        kl_term = aggregate_loss(kl_penalty(log_probs, ref_log_probs, kl_loss_type), loss_mask, loss_agg_mode,
                                 normalizer)
        loss = loss + kl_loss_coef * kl_term
        metrics = {**metrics, "actor/kl_loss": kl_term, "actor/kl_coef": jnp.asarray(kl_loss_coef, jnp.float32)}
    return LossOutput(loss, metrics)


def configured_actor_loss(log_probs: jax.Array, entropy: jax.Array, batch: Any, actor: Any,
                          normalizer: jax.Array | None = None) -> LossOutput:
    """``actor_loss`` of a ``PolicyBatch`` with the keys of ``actor_rollout_ref.actor`` (``actor``)."""
    return actor_loss(log_probs, batch.old_log_probs, batch.advantages, batch.loss_mask, entropy, batch.ref_log_probs,
                      clip_ratio_low=actor.clip_ratio_low, clip_ratio_high=actor.clip_ratio_high,
                      clip_ratio_c=actor.clip_ratio_c, entropy_coeff=actor.entropy_coeff,
                      use_kl_loss=actor.use_kl_loss, kl_loss_coef=actor.kl_loss_coef, kl_loss_type=actor.kl_loss_type,
                      loss_agg_mode=actor.loss_agg_mode, normalizer=normalizer,
                      policy_loss=actor.policy_loss.loss_mode)


# ``fn(values, old_values, returns, loss_mask, cliprange_value, loss_agg_mode, normalizer) -> LossOutput``.
CRITIC_LOSSES: Registry[Callable[..., LossOutput]] = Registry("critic loss", "critic.loss_mode")


@CRITIC_LOSSES.register("clipped")
def clipped_value_loss(values: jax.Array, old_values: jax.Array, returns: jax.Array, loss_mask: jax.Array,
                       cliprange_value: float = 0.5, loss_agg_mode: str = "token-mean",
                       normalizer: jax.Array | None = None) -> LossOutput:
    """Critic loss with value clipping (starpo.md §10, verl ``compute_value_loss``).

    ``vf = ½·agg(max((V − R)², (clip(V, V_old − c, V_old + c) − R)²))``. Metrics:
    ``critic/vf_loss``, ``critic/vf_clipfrac`` (fraction where the clipped error is larger) and
    ``critic/vpred_mean``. ``normalizer`` is that of ``aggregate_loss``.
    """
    mask = jnp.asarray(loss_mask, jnp.float32)
    values, old_values, returns = (jnp.asarray(x, jnp.float32) for x in (values, old_values, returns))
    clipped_values = jnp.clip(values, old_values - cliprange_value, old_values + cliprange_value)
    unclipped_errors = jnp.square(values - returns)
    clipped_errors = jnp.square(clipped_values - returns)
    vf_loss = 0.5 * aggregate_loss(jnp.maximum(unclipped_errors, clipped_errors), mask, loss_agg_mode, normalizer)
    metrics = {"critic/vf_loss": vf_loss,
               "critic/vf_clipfrac": masked_mean((clipped_errors > unclipped_errors).astype(jnp.float32), mask),
               "critic/vpred_mean": masked_mean(values, mask)}
    return LossOutput(vf_loss, metrics)
