"""Advantage estimators of StarPO (starpo.md §8): token-level GAE, GRPO broadcast, bi-level GAE, KL-in-reward.

Every function takes token-aligned ``(batch, length)`` arrays in the reference
layout of starpo.md §7 (position ``j`` scores token ``j + 1``) and returns
``(advantages, returns)`` or rewards; all are jittable with static shapes. ``ADVANTAGE_ESTIMATORS``
holds the estimators ``algorithm.adv_estimator`` names, each declaring what it needs (a critic,
reference log-probs); ``advantage_estimator`` registers a new one.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from runtime.registry import Registry
from starpo_jax.losses import kl_penalty
from starpo_jax.masked import masked_mean, masked_whiten
from starpo_jax.snr_filter import filter_loss_scale, soft_reweight


class AdvantageReturn(NamedTuple):
    """Per-token advantages (whitened where the estimator says so) and value targets."""

    advantages: jax.Array
    returns: jax.Array


class KLRewardOutput(NamedTuple):
    """Rewards after the KL penalty and the metrics verl logs for it."""

    token_level_rewards: jax.Array
    metrics: dict[str, jax.Array]


def _reverse_scan_over_time(step, carry, *sequences):
    """Runs ``step`` from the last position to the first over ``(batch, length)`` inputs."""
    time_major = tuple(jnp.swapaxes(x, 0, 1) for x in sequences)
    _, outputs = jax.lax.scan(step, carry, time_major, reverse=True)
    return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), outputs)


def compute_gae_advantage_return(token_level_rewards: jax.Array, values: jax.Array, loss_mask: jax.Array,
                                 gamma: float, lam: float, skip_non_response: bool = False) -> AdvantageReturn:
    """Token-level GAE with global masked whitening (verl ``compute_gae_advantage_return``, starpo.md §8.1).

    ``δ_t = r_t + γ·V_{t+1} − V_t`` (``V_T = 0``), ``A_t = δ_t + γλ·A_{t+1}``, run over every
    position, masked ones included; ``returns = A + V``; then ``A`` is whitened over
    ``loss_mask`` with the unbiased masked variance. Values are multiplied by the loss mask
    first, as verl's ``compute_values`` does with RAGEN's ``response_mask := loss_mask``.

    With ``skip_non_response`` (RAGEN-2's verl, ragen2.md §6.2) the recursion carries ``V`` and ``A``
    only through loss-mask positions: ``δ_t = r_t + γ·carry_V − V_t``, ``A'_t = δ_t + γλ·carry_A``, the
    carries take ``V_t`` and ``A'_t`` where ``m_t = 1``, and ``A_t`` is the carry after the update — so
    discounting counts assistant tokens only and rewards off the mask are ignored.

    Args:
      token_level_rewards: ``(B, T)`` rewards (normalised scores, minus any KL penalty).
      values: ``(B, T)`` critic values; position ``t`` is the value of position ``t``.
      loss_mask: ``(B, T)`` 1 on trained positions.
      gamma: discount γ (RAGEN default 1.0).
      lam: GAE λ (RAGEN default 1.0).
      skip_non_response: RAGEN-2's recursion (V1: every position).
    """
    rewards = jnp.asarray(token_level_rewards, jnp.float32)
    values = jnp.asarray(values, jnp.float32) * loss_mask
    if skip_non_response:
        def carried(carry, inputs):
            next_value, next_advantage = carry
            reward_t, value_t, mask_t = inputs
            advantage = reward_t + gamma * next_value - value_t + gamma * lam * next_advantage
            on = mask_t > 0
            carry = (jnp.where(on, value_t, next_value), jnp.where(on, advantage, next_advantage))
            return carry, carry[1]

        zeros = jnp.zeros(rewards.shape[:1], jnp.float32)
        advantages = _reverse_scan_over_time(carried, (zeros, zeros), rewards, values, jnp.asarray(loss_mask))
        return AdvantageReturn(masked_whiten(advantages, loss_mask), advantages + values)
    next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
    deltas = rewards + gamma * next_values - values

    def step(last_advantage, delta_t):
        advantage = delta_t[0] + gamma * lam * last_advantage
        return advantage, advantage

    advantages = _reverse_scan_over_time(step, jnp.zeros(rewards.shape[:1], jnp.float32), deltas)
    returns = advantages + values
    return AdvantageReturn(masked_whiten(advantages, loss_mask), returns)


def compute_grpo_outcome_advantage(token_level_rewards: jax.Array, loss_mask: jax.Array) -> AdvantageReturn:
    """GRPO advantages as RAGEN runs them (starpo.md §8.2): the normalised score broadcast over the loss mask.

    Scores are already group-normalised by ``starpo_jax.scores.normalize_scores``; verl's
    GRPO then sees groups of size 1 (mean 0, std 1), so ``A_{i,t} = Σ_t r_{i,t} · mask_{i,t}``.
    ``returns`` equal the advantages, as in verl.
    """
    scores = jnp.sum(jnp.asarray(token_level_rewards, jnp.float32), axis=-1, keepdims=True)
    advantages = scores * loss_mask
    return AdvantageReturn(advantages, advantages)


def compute_grpo_group_advantage(token_level_rewards: jax.Array, loss_mask: jax.Array, group_ids: jax.Array,
                                 norm_adv_by_std: bool = True, epsilon: float = 1e-6,
                                 episode_ids: jax.Array | None = None) -> AdvantageReturn:
    """GRPO over initial-state groups, computed in the trainer as RAGEN-2 does (ragen2.md §6.2).

    ``s_i = Σ_t r_{i,t}``; per group of ``group_ids``: mean and unbiased std (mean 0 and std 1 for a
    group of one); ``A_i = (s_i − mean) / (std + ε)``, or ``s_i − mean`` without
    ``norm_adv_by_std`` (Dr. GRPO, Liu et al. 2025). ``advantages = returns = A_i · mask``. Group ids
    may be any integers (they are renumbered inside), so filtered and duplicated rows work. With ``episode_ids``
    (per-turn samples) each (group, episode) pair enters the mean and std once (RAGEN-2's deduplication).
    """
    scores = jnp.sum(jnp.asarray(token_level_rewards, jnp.float32), axis=-1)
    mean, std = grpo_group_statistics(scores, group_ids, episode_ids)
    centred = scores - mean
    advantage = centred / (std + epsilon) if norm_adv_by_std else centred
    advantages = advantage[:, None] * loss_mask
    return AdvantageReturn(advantages, advantages)


def grpo_group_statistics(scores: jax.Array, group_ids: jax.Array,
                          episode_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Each row's group mean and unbiased std of ``scores`` (0 and 1 for a group of one, as RAGEN-2's GRPO).

    With ``episode_ids`` only the first row of each (group, episode) pair counts (``core_algos.py:26-91``), so an
    episode's turn-samples and batch-adjustment copies enter once.
    """
    rows = scores.shape[0]
    _, groups = jnp.unique(jnp.asarray(group_ids), return_inverse=True, size=rows)
    groups = groups.reshape(-1)
    weight = jnp.ones_like(scores) if episode_ids is None else first_of_pairs(groups, episode_ids).astype(scores.dtype)
    counts = jax.ops.segment_sum(weight, groups, rows)
    mean = jax.ops.segment_sum(weight * scores, groups, rows) / jnp.maximum(counts, 1.0)
    std = jnp.sqrt(jax.ops.segment_sum(weight * (scores - mean[groups]) ** 2, groups, rows)
                   / jnp.maximum(counts - 1.0, 1.0))
    single = counts[groups] == 1
    return jnp.where(single, 0.0, mean[groups]), jnp.where(single, 1.0, std[groups])


def first_of_pairs(groups: jax.Array, episode_ids: jax.Array) -> jax.Array:
    """``True`` for the first row of each (group, episode) pair."""
    episodes = jnp.asarray(episode_ids)
    same = (groups[:, None] == groups[None, :]) & (episodes[:, None] == episodes[None, :])
    return ~jnp.any(jnp.tril(same, k=-1), axis=1)


def weight_advantages_by_length(advantages: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """RAGEN ``grpo_advantage_length_weight``: divide ``A_i`` by ``(len_i + 1e-6) / mean_j len_j``."""
    lengths = jnp.sum(jnp.asarray(loss_mask, jnp.float32), axis=-1)
    relative_lengths = (lengths + 1e-6) / jnp.mean(lengths)
    return advantages / relative_lengths[:, None]


def compute_bi_level_gae_advantage_return(token_level_rewards: jax.Array, values: jax.Array,
                                          loss_mask: jax.Array, gamma: float, lam: float,
                                          high_level_gamma: float) -> AdvantageReturn:
    """Turn-level then token-level GAE (RAGEN HEAD ``compute_bi_level_gae_advantage_return``, starpo.md §8.3).

    Turn ends ``e_i`` are the positions with a non-zero reward. High level, backwards over turn
    ends: ``δ_i = r_{e_i} + γ_H·V[e_{i+1}] − V[e_i]``, ``A_{e_i} = δ_i + γ_H·λ·A_{e_{i+1}}`` and the
    reward at ``e_i`` becomes ``A_{e_i} + V[e_i]``. Low level, backwards over loss-mask positions:
    ``δ_t = r'_t + γ·V[next masked t] − V[t]``, ``A_t = δ_t + γλ·A_{t+1}``, with the next value and
    the running advantage reset to 0 at every turn end. Decision 21: the last loss-mask position
    also ends a segment, so a trajectory without any non-zero reward is one segment (the
    reference raises an index error there). Finally ``A`` is whitened over ``loss_mask``.
    """
    rewards = jnp.asarray(token_level_rewards, jnp.float32)
    mask = jnp.asarray(loss_mask, jnp.float32)
    values = jnp.asarray(values, jnp.float32) * mask
    is_turn_end = rewards != 0
    batch = rewards.shape[0]

    def high_step(carry, inputs):
        last_advantage, next_value = carry
        reward_t, value_t, end_t = inputs
        advantage = reward_t + high_level_gamma * next_value - value_t + high_level_gamma * lam * last_advantage
        carry = (jnp.where(end_t, advantage, last_advantage), jnp.where(end_t, value_t, next_value))
        return carry, jnp.where(end_t, advantage, 0.0)

    zeros = jnp.zeros((batch,), jnp.float32)
    high_advantages = _reverse_scan_over_time(high_step, (zeros, zeros), rewards, values, is_turn_end)
    turn_rewards = jnp.where(is_turn_end, high_advantages + values, rewards)

    def low_step(carry, inputs):
        last_advantage, next_value, seen_masked = carry
        reward_t, value_t, end_t, mask_t, high_t = inputs
        segment_end = end_t | ~seen_masked
        next_value = jnp.where(segment_end, 0.0, next_value)
        last_advantage = jnp.where(segment_end, 0.0, last_advantage)
        advantage = reward_t + gamma * next_value - value_t + gamma * lam * last_advantage
        in_mask = mask_t > 0
        carry = (jnp.where(in_mask, advantage, carry[0]), jnp.where(in_mask, value_t, carry[1]),
                 seen_masked | in_mask)
        return carry, jnp.where(in_mask, advantage, high_t)

    false = jnp.zeros((batch,), bool)
    advantages = _reverse_scan_over_time(low_step, (zeros, zeros, false), turn_rewards, values, is_turn_end,
                                         mask, high_advantages)
    on_turn_end_or_mask = is_turn_end | (mask > 0)
    returns = jnp.where(on_turn_end_or_mask, advantages + values, 0.0)
    return AdvantageReturn(masked_whiten(advantages, mask), returns)


def apply_kl_penalty(token_level_scores: jax.Array, old_log_probs: jax.Array, ref_log_probs: jax.Array,
                     loss_mask: jax.Array, kl_coef: float, kl_penalty_type: str = "kl") -> KLRewardOutput:
    """KL-in-reward with a fixed controller (verl ``apply_kl_penalty``, starpo.md §10 KL placement).

    ``rewards = scores − β·KL(old, ref)·mask``; the logged KL is the batch mean of each
    sequence's masked mean KL, as ``actor/reward_kl_penalty`` with ``β`` as ``..._coeff``.
    """
    kld = kl_penalty(old_log_probs, ref_log_probs, kl_penalty_type) * loss_mask
    rewards = jnp.asarray(token_level_scores, jnp.float32) - kl_coef * kld
    current_kl = jnp.mean(masked_mean(kld, loss_mask, axis=-1))
    metrics = {"actor/reward_kl_penalty": current_kl,
               "actor/reward_kl_penalty_coeff": jnp.asarray(kl_coef, jnp.float32)}
    return KLRewardOutput(rewards, metrics)


class AdvantageInputs(NamedTuple):
    """What every advantage estimator receives: the token rewards and the batch around them.

    Rows are the filtered batch, group-major: ``group_ids[i]`` is row ``i``'s initial-state group.
    ``values`` is ``None`` unless the estimator declares ``needs_critic``. ``episode_ids``: row ``i``'s episode
    when rows are per-turn samples (RAGEN-2's turn-level ``context_window_mode``), else ``None``.
    """

    token_level_rewards: jax.Array
    values: jax.Array | None
    loss_mask: jax.Array
    group_ids: jax.Array
    old_log_probs: jax.Array
    ref_log_probs: jax.Array
    episode_ids: jax.Array | None = None


class AdvantageEstimator(NamedTuple):
    """A registered estimator: ``fn(inputs, config) -> AdvantageReturn`` and what it needs.

    ``config`` is the whole ``StarPOConfig`` (an estimator reads its own keys). ``needs_critic``
    makes the run build and train a critic; ``needs_ref_log_probs`` runs the reference policy.
    """

    fn: Callable[[AdvantageInputs, Any], AdvantageReturn]
    needs_critic: bool = False
    needs_ref_log_probs: bool = False


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator", "algorithm.adv_estimator")


def advantage_estimator(name: str, *, needs_critic: bool = False, needs_ref_log_probs: bool = False):
    """Decorator registering ``fn(inputs: AdvantageInputs, config) -> AdvantageReturn`` under ``name``."""
    def register(fn):
        ADVANTAGE_ESTIMATORS.register(name, AdvantageEstimator(fn, needs_critic, needs_ref_log_probs))
        return fn

    return register


@advantage_estimator("gae", needs_critic=True)
def gae_advantages(inputs: AdvantageInputs, config: Any) -> AdvantageReturn:
    """Token-level GAE, or bi-level GAE with ``algorithm.bi_level_gae`` (starpo.md §8.1, §8.3)."""
    algorithm = config.algorithm
    if inputs.values is None:
        raise ValueError("values (critic) are required for algorithm.adv_estimator=gae")
    if algorithm.bi_level_gae:
        return compute_bi_level_gae_advantage_return(inputs.token_level_rewards, inputs.values, inputs.loss_mask,
                                                     algorithm.gamma, algorithm.lam, algorithm.high_level_gamma)
    return compute_gae_advantage_return(inputs.token_level_rewards, inputs.values, inputs.loss_mask,
                                        algorithm.gamma, algorithm.lam, skip_non_response=config.ragen_version == "v2")


@advantage_estimator("grpo")
def grpo_advantages(inputs: AdvantageInputs, config: Any) -> AdvantageReturn:
    """GRPO: V1 broadcasts the context manager's normalised score; V2 normalises per initial-state group here
    (Dr. GRPO without ``algorithm.norm_adv_by_std_in_grpo``); then divided by the relative length with
    ``grpo_advantage_length_weight``."""
    if config.ragen_version == "v2":
        out = compute_grpo_group_advantage(inputs.token_level_rewards, inputs.loss_mask, inputs.group_ids,
                                           config.algorithm.norm_adv_by_std_in_grpo, episode_ids=inputs.episode_ids)
    else:
        out = compute_grpo_outcome_advantage(inputs.token_level_rewards, inputs.loss_mask)
    if config.grpo_advantage_length_weight:
        out = out._replace(advantages=weight_advantages_by_length(out.advantages, inputs.loss_mask))
    return out


def scale_advantages(adv: AdvantageReturn, token_level_rewards: jax.Array, group_ids: jax.Array, config: Any,
                     kept_ratio: float, episode_ids: jax.Array | None = None
                     ) -> tuple[AdvantageReturn, dict[str, jax.Array]]:
    """RAGEN-2's advantage factors after the estimator (ragen2.md §4.6-§4.7); value targets are unchanged.

    ``algorithm.soft_advantage_reweight``: ``A ← σ_g / (max σ + 1e-6) · A`` with each row's GRPO group std;
    then ``actor.filter_loss_scaling``: ``A ← ρ · A`` (``linear``) or ``√ρ · A`` (``sqrt``), ``ρ`` the kept
    fraction of groups. ``episode_ids``: per-turn samples' episodes, each counted once in the group std.
    """
    advantages, metrics = adv.advantages, {}
    if config.algorithm.soft_advantage_reweight:
        _, std = grpo_group_statistics(jnp.sum(jnp.asarray(token_level_rewards, jnp.float32), axis=-1), group_ids,
                                       episode_ids)
        weights = soft_reweight(std)
        advantages = advantages * weights[:, None]
        metrics = {"train/soft_reweight_min": jnp.min(weights), "train/soft_reweight_max": jnp.max(weights),
                   "train/soft_reweight_mean": jnp.mean(weights)}
    scale = filter_loss_scale(config.actor_rollout_ref.actor.filter_loss_scaling, kept_ratio)
    return adv._replace(advantages=advantages * scale), metrics


def compute_advantage(inputs: AdvantageInputs, config: Any) -> AdvantageReturn:
    """Advantages of the registered ``config.algorithm.adv_estimator`` (RAGEN ``compute_advantage``, §9 step 9)."""
    return ADVANTAGE_ESTIMATORS.get(config.algorithm.adv_estimator).fn(inputs, config)
