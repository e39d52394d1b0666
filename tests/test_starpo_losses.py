"""Actor and critic losses, KL estimators, entropy and aggregation against plain NumPy (starpo.md §10)."""

import jax
import numpy as np
import pytest

from starpo_jax.losses import (actor_loss, aggregate_loss, clipped_value_loss, decoupled_clip_loss,
                               entropy_from_logits, kl_penalty, loss_normalizer)

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def random_batch(seed, batch=5, length=9):
    rng = np.random.default_rng(seed)
    mask = (rng.random((batch, length)) < 0.6).astype(np.float32)
    mask[:, 0] = 0.0  # left padding
    mask[-1] = 0.0  # an all-padding row
    mask[0, -1] = 1.0
    old = rng.normal(size=(batch, length)) - 1.0
    new = old + rng.normal(size=(batch, length)) * 0.4
    advantages = rng.normal(size=(batch, length))
    return rng, mask, new, old, advantages


def np_aggregate(loss, mask, mode):
    rows = [b for b in range(loss.shape[0]) if mask[b].sum() > 0]
    if mode == "token-mean":
        return (loss * mask).sum() / (mask.sum() + 1e-8)
    if mode == "seq-mean-token-mean":
        return np.mean([(loss[b] * mask[b]).sum() / mask[b].sum() for b in rows])
    if mode == "seq-mean-token-sum":
        return np.mean([(loss[b] * mask[b]).sum() for b in rows])
    return (loss * mask).sum() / loss.shape[1]


@pytest.mark.parametrize("mode", MODES)
def test_aggregation_modes_match_numpy(mode):
    _, mask, loss, _, _ = random_batch(0)
    np.testing.assert_allclose(aggregate_loss(loss, mask, mode), np_aggregate(loss, mask, mode), rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_with_the_mini_batch_normalizer_sum_to_the_mini_batch_loss(mode):
    rng, mask, new, old, adv = random_batch(6, batch=6)
    entropy = rng.uniform(0, 2, size=new.shape)
    kwargs = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, entropy_coeff=0.001, use_kl_loss=True,
                  kl_loss_coef=0.01, loss_agg_mode=mode)
    full = actor_loss(new, old, adv, mask, entropy, old, **kwargs).loss
    normalizer = loss_normalizer(mask, mode)
    micro = sum(float(actor_loss(new[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], entropy[i:i + 2],
                                 old[i:i + 2], normalizer=normalizer, **kwargs).loss) for i in range(0, 6, 2))
    assert micro == pytest.approx(float(full), rel=1e-5)


def test_aggregation_hand_worked():
    loss = np.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = np.array([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert float(aggregate_loss(loss, mask, "token-mean")) == pytest.approx(10 / 4)
    assert float(aggregate_loss(loss, mask, "seq-mean-token-mean")) == pytest.approx((2 + 4) / 2)
    assert float(aggregate_loss(loss, mask, "seq-mean-token-sum")) == pytest.approx((6 + 4) / 2)
    assert float(aggregate_loss(loss, mask, "seq-mean-token-sum-norm")) == pytest.approx(10 / 3)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate_loss(loss, mask, "sum", normalizer=1.0)


def np_policy_loss(new, old, adv, mask, low, high, c):
    batch, length = new.shape
    losses = np.zeros_like(new)
    clipped_flags = np.zeros_like(new)
    lower_flags = np.zeros_like(new)
    for b in range(batch):
        for t in range(length):
            ratio = np.exp(new[b, t] - old[b, t])
            a = adv[b, t]
            l1 = -a * ratio
            l2 = -a * min(max(ratio, 1 - low), 1 + high)
            loss = max(l1, l2)
            clipped_flags[b, t] = float(l2 > l1)
            if c is not None and a < 0:
                lower_flags[b, t] = float(loss > -a * c)
                loss = min(loss, -a * c)
            losses[b, t] = loss
    n = mask.sum() + 1e-8
    return (losses, (clipped_flags * mask).sum() / n, (lower_flags * mask).sum() / n,
            ((old - new) * mask).sum() / n)


@pytest.mark.parametrize("clip_ratio_c", [3.0, None])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_decoupled_clip_loss_matches_numpy(clip_ratio_c, mode):
    _, mask, new, old, adv = random_batch(1)
    adv[1, 3], new[1, 3], old[1, 3] = -2.0, 1.0, -1.5  # ratio e^2.5 ~ 12 > c: dual clip binds
    out = decoupled_clip_loss(new, old, adv, mask, 0.2, 0.28, clip_ratio_c, mode)
    losses, clipfrac, lower, ppo_kl = np_policy_loss(new, old, adv, mask, 0.2, 0.28, clip_ratio_c)
    np.testing.assert_allclose(out.loss, np_aggregate(losses, mask, mode), rtol=1e-5)
    np.testing.assert_allclose(out.metrics["actor/pg_loss"], out.loss)
    np.testing.assert_allclose(out.metrics["actor/pg_clipfrac"], clipfrac, rtol=1e-5)
    np.testing.assert_allclose(out.metrics["actor/pg_clipfrac_lower"], lower, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(out.metrics["actor/ppo_kl"], ppo_kl, rtol=1e-5, atol=1e-7)
    if clip_ratio_c is not None:
        assert float(out.metrics["actor/pg_clipfrac_lower"]) > 0


def test_decoupled_clip_hand_worked():
    # A = 1, ratio 1.5: clipped at 1 + 0.28 -> loss -1.28; A = -1, ratio 0.5: clipped at 0.8 -> 0.8
    # A = -1, ratio 5: unclipped 5, dual clip c = 3 -> 3
    new = np.log(np.array([[1.5, 0.5, 5.0]]))
    old = np.zeros((1, 3))
    adv = np.array([[1.0, -1.0, -1.0]])
    mask = np.ones((1, 3))
    out = decoupled_clip_loss(new, old, adv, mask, 0.2, 0.28, 3.0, "token-mean")
    assert float(out.loss) == pytest.approx((-1.28 + 0.8 + 3.0) / 3, rel=1e-5)
    assert float(out.metrics["actor/pg_clipfrac"]) == pytest.approx(2 / 3, rel=1e-5)
    assert float(out.metrics["actor/pg_clipfrac_lower"]) == pytest.approx(1 / 3, rel=1e-5)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        decoupled_clip_loss(new, old, adv, mask, 0.2, 0.28, 1.0)


def test_gradient_is_zero_where_clipped_and_flows_elsewhere():
    new = np.log(np.array([[1.5, 1.1]]))
    grad = jax.grad(lambda lp: decoupled_clip_loss(lp, np.zeros((1, 2)), np.ones((1, 2)), np.ones((1, 2)),
                                                   0.2, 0.28, 3.0, "token-mean").loss)(new)
    assert float(grad[0, 0]) == 0.0
    assert float(grad[0, 1]) == pytest.approx(-1.1 / 2, rel=1e-5)


def test_entropy_from_logits_with_temperature():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(2, 3, 6)) * 3
    for temperature in (1.0, 0.5):
        expected = np.zeros((2, 3))
        for b in range(2):
            for t in range(3):
                z = logits[b, t] / temperature
                p = np.exp(z - z.max())
                p /= p.sum()
                expected[b, t] = -(p * np.log(p)).sum()
        np.testing.assert_allclose(entropy_from_logits(logits, temperature), expected, rtol=1e-5, atol=2e-6)
    uniform = entropy_from_logits(np.zeros((1, 8)))
    assert float(uniform[0]) == pytest.approx(np.log(8), rel=1e-6)


@pytest.mark.parametrize("kl_type", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_kl_estimators_match_numpy(kl_type):
    rng = np.random.default_rng(3)
    logp, ref = rng.normal(size=(3, 4)), rng.normal(size=(3, 4))
    logp[0, 0], ref[0, 0] = -30.0, 0.0  # k3 clamps exp(30) to 10
    d = logp - ref
    expected = {"kl": d, "k1": d, "abs": np.abs(d), "mse": 0.5 * d ** 2, "k2": 0.5 * d ** 2,
                "low_var_kl": np.clip(np.exp(np.clip(-d, -20, 20)) - np.clip(-d, -20, 20) - 1, -10, 10)}
    expected["k3"] = expected["low_var_kl"]
    np.testing.assert_allclose(kl_penalty(logp, ref, kl_type), expected[kl_type], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="kl_loss_type"):
        kl_penalty(logp, ref, "full")


@pytest.mark.parametrize("use_kl_loss", [False, True])
def test_actor_loss_combines_terms(use_kl_loss):
    rng, mask, new, old, adv = random_batch(4)
    entropy = rng.uniform(0, 3, size=new.shape)
    ref = old + rng.normal(size=new.shape) * 0.1
    mode = "seq-mean-token-mean"
    out = actor_loss(new, old, adv, mask, entropy, ref, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                     entropy_coeff=0.001, use_kl_loss=use_kl_loss, kl_loss_coef=0.01, kl_loss_type="kl",
                     loss_agg_mode=mode)
    losses, *_ = np_policy_loss(new, old, adv, mask, 0.2, 0.28, 3.0)
    expected = np_aggregate(losses, mask, mode) - 0.001 * np_aggregate(entropy, mask, mode)
    if use_kl_loss:
        expected += 0.01 * np_aggregate(new - ref, mask, mode)
        assert float(out.metrics["actor/kl_coef"]) == pytest.approx(0.01)
    else:
        assert "actor/kl_loss" not in out.metrics
    np.testing.assert_allclose(out.loss, expected, rtol=1e-5)
    np.testing.assert_allclose(out.metrics["actor/entropy_loss"], np_aggregate(entropy, mask, mode), rtol=1e-5)
    with pytest.raises(ValueError, match="use_kl_loss"):
        actor_loss(new, old, adv, mask, entropy, None, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=None,
                   entropy_coeff=0.0, use_kl_loss=True, kl_loss_coef=0.001)


def test_clipped_value_loss_matches_numpy():
    rng, mask, _, _, _ = random_batch(5)
    old_values = rng.normal(size=mask.shape)
    values = old_values + rng.normal(size=mask.shape)
    returns = rng.normal(size=mask.shape)
    out = clipped_value_loss(values, old_values, returns, mask, 0.5)
    errors = np.zeros_like(values)
    flags = np.zeros_like(values)
    for b in range(values.shape[0]):
        for t in range(values.shape[1]):
            clipped = min(max(values[b, t], old_values[b, t] - 0.5), old_values[b, t] + 0.5)
            e1, e2 = (values[b, t] - returns[b, t]) ** 2, (clipped - returns[b, t]) ** 2
            errors[b, t], flags[b, t] = max(e1, e2), float(e2 > e1)
    n = mask.sum() + 1e-8
    np.testing.assert_allclose(out.loss, 0.5 * (errors * mask).sum() / n, rtol=1e-5)
    np.testing.assert_allclose(out.metrics["critic/vf_clipfrac"], (flags * mask).sum() / n, rtol=1e-5)
    np.testing.assert_allclose(out.metrics["critic/vpred_mean"], (values * mask).sum() / n, rtol=1e-5)
    # hand-worked: V = 2, V_old = 0, R = 0 -> max(4, 0.25) / 2 = 2
    assert float(clipped_value_loss(np.array([[2.0]]), np.zeros((1, 1)), np.zeros((1, 1)),
                                    np.ones((1, 1))).loss) == pytest.approx(2.0, rel=1e-6)
