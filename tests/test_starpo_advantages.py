"""GAE, GRPO, bi-level GAE and KL-in-reward against plain NumPy loops (starpo.md §8, §10)."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime.mesh import MeshConfig, batch_sharding, make_mesh
from starpo_jax.advantages import (ADVANTAGE_ESTIMATORS, AdvantageInputs, apply_kl_penalty, compute_advantage,
                                   compute_bi_level_gae_advantage_return, compute_gae_advantage_return,
                                   compute_grpo_group_advantage, compute_grpo_outcome_advantage,
                                   weight_advantages_by_length)
from starpo_jax.config import StarPOConfig
from starpo_jax.filtering import filter_groups_by_reward_std
from starpo_jax.losses import decoupled_clip_loss
from starpo_jax.scores import normalize_scores, place_scores_on_last_token


def left_padded_mask(rng, batch, length):
    """Masks like the reference layout: left padding, a prompt, then trained positions and gaps."""
    mask = (rng.random((batch, length)) < 0.7).astype(np.float32)
    for row in range(batch):
        pad = rng.integers(0, length // 3)
        mask[row, :pad] = 0.0
        mask[row, -1] = 1.0
    return mask


def np_whiten(values, mask):
    n = mask.sum()
    mean = (values * mask).sum() / n
    var = (((values - mean) ** 2) * mask).sum() / n * n / (n - 1)
    return (values - mean) / np.sqrt(var + 1e-8)


def np_gae(rewards, values, mask, gamma, lam):
    values = values * mask
    batch, length = rewards.shape
    advantages = np.zeros((batch, length))
    for b in range(batch):
        last = 0.0
        for t in reversed(range(length)):
            next_value = values[b, t + 1] if t < length - 1 else 0.0
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            last = delta + gamma * lam * last
            advantages[b, t] = last
    return np_whiten(advantages, mask), advantages + values


def np_bi_level(rewards, values, mask, gamma, lam, high_gamma):
    values = values * mask
    batch, length = rewards.shape
    advantages = np.zeros((batch, length))
    returns = np.zeros((batch, length))
    updated = rewards.copy()
    for b in range(batch):
        ends = [t for t in range(length) if rewards[b, t] != 0]
        last = 0.0
        for i in reversed(range(len(ends))):
            next_value = values[b, ends[i + 1]] if i < len(ends) - 1 else 0.0
            last = rewards[b, ends[i]] + high_gamma * next_value - values[b, ends[i]] + high_gamma * lam * last
            advantages[b, ends[i]] = last
        for pos in ends:
            returns[b, pos] = advantages[b, pos] + values[b, pos]
            updated[b, pos] = advantages[b, pos] + values[b, pos]
        valid = [t for t in range(length) if mask[b, t] > 0]
        last = 0.0
        for i in reversed(range(len(valid))):
            pos = valid[i]
            if pos in ends or i == len(valid) - 1:
                next_value, last = 0.0, 0.0
            else:
                next_value = values[b, valid[i + 1]]
            last = updated[b, pos] + gamma * next_value - values[b, pos] + gamma * lam * last
            advantages[b, pos] = last
            returns[b, pos] = last + values[b, pos]
    return np_whiten(advantages, mask), returns


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.5)])
def test_gae_matches_numpy_loop(gamma, lam):
    rng = np.random.default_rng(0)
    mask = left_padded_mask(rng, 5, 13)
    rewards = rng.normal(size=(5, 13)) * (rng.random((5, 13)) < 0.3)
    values = rng.normal(size=(5, 13))
    out = jax.jit(compute_gae_advantage_return, static_argnums=(3, 4))(rewards, values, mask, gamma, lam)
    expected_adv, expected_ret = np_gae(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(out.returns, expected_ret, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.advantages) * mask, expected_adv * mask, atol=1e-4)


def test_gae_last_token_reward_telescopes_to_score_minus_value():
    rng = np.random.default_rng(1)
    mask = left_padded_mask(rng, 4, 9)
    score = rng.normal(size=4)
    rewards = np.zeros((4, 9))
    rewards[:, -1] = score
    values = rng.normal(size=(4, 9))
    out = compute_gae_advantage_return(rewards, values, mask, 1.0, 1.0)
    np.testing.assert_allclose(out.returns, np.broadcast_to(score[:, None], (4, 9)), atol=1e-5)
    raw = score[:, None] - values * mask
    np.testing.assert_allclose(np.asarray(out.advantages) * mask, np_whiten(raw, mask) * mask, atol=1e-4)
    whitened = np.asarray(out.advantages)[mask > 0]
    assert abs(whitened.mean()) < 1e-5 and abs(whitened.std(ddof=1) - 1.0) < 1e-3


@pytest.mark.parametrize("high_gamma,gamma,lam", [(0.95, 1.0, 1.0), (0.9, 0.97, 0.9)])
def test_bi_level_gae_matches_numpy_loop_with_turn_rewards(high_gamma, gamma, lam):
    rng = np.random.default_rng(2)
    batch, length = 4, 16
    mask = left_padded_mask(rng, batch, length)
    rewards = np.zeros((batch, length))
    for b in range(batch):
        masked = np.flatnonzero(mask[b])
        ends = rng.choice(masked[:-1], size=2, replace=False)
        rewards[b, ends] = rng.normal(size=2)
        rewards[b, masked[-1]] = rng.normal()
    values = rng.normal(size=(batch, length))
    out = compute_bi_level_gae_advantage_return(rewards, values, mask, gamma, lam, high_gamma)
    expected_adv, expected_ret = np_bi_level(rewards, values, mask, gamma, lam, high_gamma)
    np.testing.assert_allclose(out.returns, expected_ret, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.advantages) * mask, expected_adv * mask, atol=1e-4)


def test_bi_level_gae_zero_reward_trajectory_is_one_segment():
    """Decision 21: a row without non-zero reward (the reference crashes) is one segment."""
    rng = np.random.default_rng(3)
    mask = left_padded_mask(rng, 3, 10)
    rewards = np.zeros((3, 10))
    rewards[0, -1] = 1.5
    values = rng.normal(size=(3, 10))
    out = compute_bi_level_gae_advantage_return(rewards, values, mask, 1.0, 1.0, 0.95)
    assert np.all(np.isfinite(out.advantages)) and np.all(np.isfinite(out.returns))
    expected_adv, expected_ret = np_bi_level(rewards, values, mask, 1.0, 1.0, 0.95)
    np.testing.assert_allclose(out.returns, expected_ret, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.advantages) * mask, expected_adv * mask, atol=1e-4)
    # hand-worked, gamma = lam = 1, reward 0: A_t = -V_t at each masked t, returns = 0 there
    row = 1
    np.testing.assert_allclose(np.asarray(out.returns)[row][mask[row] > 0], 0.0, atol=1e-6)


def test_bi_level_single_final_reward_equals_masked_gae_hand_worked():
    """One masked segment [1, 2, 3], reward 2 on the last token, gamma = lam = 1, high gamma 0.5."""
    rewards = np.array([[0.0, 0.0, 0.0, 2.0]])
    values = np.array([[9.0, 0.5, 0.25, 1.0]])
    mask = np.array([[0.0, 1.0, 1.0, 1.0]])
    out = compute_bi_level_gae_advantage_return(rewards, values, mask, 1.0, 1.0, 0.5)
    # high level: A_e = 2 - 1 = 1, r' = 2; low level: A_3 = 2 - 1 = 1, A_2 = 0 + 1 - .25 + 1 = 1.75,
    # A_1 = 0 + .25 - .5 + 1.75 = 1.5; returns = A + V = [0, 2, 2, 2]
    np.testing.assert_allclose(out.returns, [[0.0, 2.0, 2.0, 2.0]], atol=1e-6)
    raw = np.array([[0.0, 1.5, 1.75, 1.0]])
    np.testing.assert_allclose(np.asarray(out.advantages) * mask, np_whiten(raw, mask) * mask, atol=1e-5)


def test_grpo_broadcasts_score_over_mask_and_length_weighting():
    rng = np.random.default_rng(4)
    mask = left_padded_mask(rng, 6, 8)
    rewards = np.zeros((6, 8))
    rewards[:, -1] = rng.normal(size=6)
    out = compute_grpo_outcome_advantage(rewards, mask)
    for b in range(6):
        for t in range(8):
            assert np.isclose(out.advantages[b, t], rewards[b, -1] * mask[b, t], atol=1e-6)
    np.testing.assert_array_equal(out.returns, out.advantages)
    weighted = weight_advantages_by_length(out.advantages, mask)
    lengths = mask.sum(-1)
    for b in range(6):
        relative = (lengths[b] + 1e-6) / lengths.mean()
        np.testing.assert_allclose(weighted[b], np.asarray(out.advantages[b]) / relative, rtol=1e-5)


@pytest.mark.parametrize("kl_type", ["kl", "low_var_kl"])
def test_kl_in_reward_matches_numpy(kl_type):
    rng = np.random.default_rng(5)
    mask = left_padded_mask(rng, 4, 7)
    scores = rng.normal(size=(4, 7))
    old, ref = rng.normal(size=(4, 7)) - 2, rng.normal(size=(4, 7)) - 2
    out = apply_kl_penalty(scores, old, ref, mask, 0.001, kl_type)
    if kl_type == "kl":
        kld = (old - ref) * mask
    else:
        d = np.clip(ref - old, -20, 20)
        kld = np.clip(np.exp(d) - d - 1, -10, 10) * mask
    np.testing.assert_allclose(out.token_level_rewards, scores - 0.001 * kld, atol=1e-6)
    per_row = [(kld[b] * mask[b]).sum() / (mask[b].sum() + 1e-8) for b in range(4)]
    np.testing.assert_allclose(out.metrics["actor/reward_kl_penalty"], np.mean(per_row), rtol=1e-5)
    assert float(out.metrics["actor/reward_kl_penalty_coeff"]) == pytest.approx(0.001)


def scores_to_actor_loss(scores, penalty, values, log_probs, old_log_probs, mask):
    """normalise (mean_std, per state) -> filter top half of groups -> last-token reward -> GAE -> loss."""
    groups, size = 4, 4
    group_ids = jnp.repeat(jnp.arange(groups), size)
    kept = filter_groups_by_reward_std((scores + penalty).reshape(groups, size), 0.5, "std")
    normalized = normalize_scores(scores, penalty, group_ids, groups, "mean_std")
    rows = kept.sample_indices
    rewards = place_scores_on_last_token(normalized[rows], mask.shape[1])
    train_mask = mask[rows] * kept.sample_mask[:, None]
    adv = compute_gae_advantage_return(rewards, values[rows], train_mask, 1.0, 1.0)
    out = decoupled_clip_loss(log_probs[rows], old_log_probs[rows], adv.advantages, train_mask, 0.2, 0.28)
    return out.loss, adv.returns, kept.metrics["rollout/chosen_in_group_std"]


def test_jitted_pipeline_on_sharded_batch_equals_single_device():
    rng = np.random.default_rng(6)
    batch, length = 16, 10
    mask = left_padded_mask(rng, batch, length).astype(np.float32)
    inputs = [rng.normal(size=batch).astype(np.float32), (-0.1 * rng.integers(0, 2, batch)).astype(np.float32),
              rng.normal(size=(batch, length)).astype(np.float32),
              rng.normal(size=(batch, length)).astype(np.float32) - 1.0,
              rng.normal(size=(batch, length)).astype(np.float32) - 1.0, mask]
    single = jax.jit(scores_to_actor_loss)(*inputs)
    mesh = make_mesh(MeshConfig(data=8, fsdp=1, tensor=1))
    sharded_inputs = [jax.device_put(x, batch_sharding(mesh, x.ndim)) for x in inputs]
    run = jax.jit(chex.assert_max_traces(scores_to_actor_loss, n=1))
    for _ in range(2):
        sharded = run(*sharded_inputs)
    chex.clear_trace_counter()
    for a, b in zip(sharded, single):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert sharded[1].shape == (8, length)


def _estimate(name, rewards, values, mask, grpo_length_weight=False, **algorithm):
    config = StarPOConfig(grpo_advantage_length_weight=grpo_length_weight)
    config = dataclasses.replace(config, algorithm=dataclasses.replace(config.algorithm, adv_estimator=name,
                                                                       **algorithm))
    zeros = np.zeros(mask.shape, np.float32)
    inputs = AdvantageInputs(rewards, values, mask, np.arange(mask.shape[0]), zeros, zeros)
    return compute_advantage(inputs, config)


def test_compute_advantage_dispatches_on_the_estimator_name():
    rng = np.random.default_rng(7)
    mask = left_padded_mask(rng, 3, 6)
    rewards = np.zeros((3, 6))
    rewards[:, -1] = rng.normal(size=3)
    values = rng.normal(size=(3, 6))
    gae = _estimate("gae", rewards, values, mask, gamma=0.9, lam=0.8)
    np.testing.assert_allclose(gae.returns, np_gae(rewards, values, mask, 0.9, 0.8)[1], atol=1e-5)
    bi = _estimate("gae", rewards, values, mask, bi_level_gae=True, high_level_gamma=0.5)
    np.testing.assert_allclose(bi.returns, np_bi_level(rewards, values, mask, 1.0, 1.0, 0.5)[1], atol=1e-5)
    grpo = _estimate("grpo", rewards, None, mask, grpo_length_weight=True)
    lengths = mask.sum(-1)
    expected = rewards[:, -1:] * mask / ((lengths[:, None] + 1e-6) / lengths.mean())
    np.testing.assert_allclose(grpo.advantages, expected, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="adv_estimator"):
        _estimate("rloo", rewards, values, mask)
    with pytest.raises(ValueError, match="values"):
        _estimate("gae", rewards, None, mask)
    assert ADVANTAGE_ESTIMATORS["gae"].needs_critic and not ADVANTAGE_ESTIMATORS["grpo"].needs_critic


# --- RAGEN-2 (ragen2.md §6.2) -------------------------------------------------------------------------------------

def numpy_gae_skipping_non_response(rewards, values, mask, gamma, lam):
    values = values * mask
    advantages = np.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        carry_v = carry_a = 0.0
        for t in reversed(range(rewards.shape[1])):
            delta = rewards[b, t] + gamma * carry_v - values[b, t]
            a = delta + gamma * lam * carry_a
            if mask[b, t]:
                carry_v, carry_a = values[b, t], a
            advantages[b, t] = carry_a
    return advantages, advantages + values


def test_v2_gae_carries_values_and_advantages_through_response_positions_only():
    rng = np.random.default_rng(4)
    rewards = rng.normal(size=(3, 9)).astype(np.float32)
    values = rng.normal(size=(3, 9)).astype(np.float32)
    mask = (rng.random((3, 9)) < 0.6).astype(np.float32)
    mask[:, -1] = 1.0
    out = compute_gae_advantage_return(rewards, values, mask, 0.9, 0.8, skip_non_response=True)
    advantages, returns = numpy_gae_skipping_non_response(rewards, values, mask, 0.9, 0.8)
    np.testing.assert_allclose(np.asarray(out.returns), returns, rtol=1e-5, atol=1e-5)
    on = mask > 0
    whitened = (advantages - advantages[on].mean()) / np.sqrt(advantages[on].var(ddof=1) + 1e-8)
    np.testing.assert_allclose(np.asarray(out.advantages)[on], whitened[on], rtol=1e-4, atol=1e-5)
    v1 = compute_gae_advantage_return(rewards, values, mask, 0.9, 0.8)
    assert not np.allclose(np.asarray(v1.returns), returns)  # γ, λ < 1: the two recursions differ
    reward_at_end = np.zeros((2, 6), np.float32)
    reward_at_end[:, -1] = [1.0, 3.0]
    values_2 = rng.normal(size=(2, 6)).astype(np.float32)
    mask_2 = np.array([[0, 1, 1, 0, 1, 1], [1, 1, 0, 0, 1, 1]], np.float32)
    same = [compute_gae_advantage_return(reward_at_end, values_2, mask_2, 1.0, 1.0, skip_non_response=s)
            for s in (False, True)]
    np.testing.assert_allclose(np.asarray(same[0].returns) * mask_2, np.asarray(same[1].returns) * mask_2, atol=1e-5)


def test_grpo_per_group_and_dr_grpo_against_numpy():
    scores = np.array([1.0, 0.0, 1.0, 1.0, 2.0, 5.0, 7.0], np.float32)
    groups = np.array([4, 4, 4, 9, 9, 2, 2])  # any ids; the lone group below gets mean 0, std 1
    rewards = np.zeros((8, 3), np.float32)
    rewards[:7, -1] = scores
    rewards[7, -1] = 3.0
    groups = np.append(groups, 11)
    mask = np.ones((8, 3), np.float32)
    mask[0, 0] = 0.0
    out = compute_grpo_group_advantage(rewards, mask, groups)
    expected = []
    for i, g in enumerate(groups):
        members = rewards[groups == g, -1]
        mean, std = (0.0, 1.0) if len(members) == 1 else (members.mean(), members.std(ddof=1))
        expected.append((rewards[i, -1] - mean) / (std + 1e-6))
    np.testing.assert_allclose(np.asarray(out.advantages), np.asarray(expected)[:, None] * mask, rtol=1e-5, atol=1e-6)
    dr = compute_grpo_group_advantage(rewards, mask, groups, norm_adv_by_std=False)
    centred = [rewards[i, -1] - (0.0 if (groups == g).sum() == 1 else rewards[groups == g, -1].mean())
               for i, g in enumerate(groups)]
    np.testing.assert_allclose(np.asarray(dr.advantages), np.asarray(centred)[:, None] * mask, rtol=1e-6)
    equal = compute_grpo_group_advantage(np.ones((4, 2), np.float32), np.ones((4, 2)), np.array([0, 0, 1, 1]))
    assert np.all(np.asarray(equal.advantages) == 0.0)
