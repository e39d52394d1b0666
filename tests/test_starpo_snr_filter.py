"""RAGEN-2's rollout filter: the reference's conformance vectors (ragen2.md §4.11) and the rules of §4.4–§4.7."""

import numpy as np
import pytest

from starpo_jax.snr_filter import (SnrFilterConfig, SnrSelection, adjust_batch_size, filter_loss_scale,
                                   select_groups, soft_reweight)


def top_p(value, mode, include_zero=True):
    return SnrFilterConfig(strategy="top_p", value=value, top_p_prob_mode=mode, include_zero=include_zero)


@pytest.mark.parametrize("config, scores, kept", [
    (top_p(0.6, "softmax"), [1, 1, 1], [0, 1]),
    (top_p(0.6, "linear"), [4, 3, 2, 1], [0, 1]),
    (top_p(0.9, "linear"), [0, 0, 0], []),
    (top_p(1.0, "linear"), [4, 2, 0, 0], [0, 1, 2, 3]),
    (top_p(1.0, "linear"), [0, 0, 0], [0, 1, 2]),
    (top_p(1.0, "linear"), [1, 3, 2], [0, 1, 2]),
    (top_p(0.9, "softmax", False), [10, 1, 0, 0], [0]),
    (top_p(0.9, "softmax", False), [4, 2, 0, 0], [0, 1]),
    (top_p(0.6, "softmax", False), [1, 1, 1, 0], [0, 1]),
    (top_p(0.9, "linear", False), [10, 1, 0, 0], [0]),
    (top_p(0.9, "linear", False), [4, 2, 0, 0], [0, 1]),
    (top_p(0.9, "linear", False), [3, 1, 1, 0], [0, 1, 2]),
    (top_p(0.9, "linear"), [0.004, 0.003, 0.002], []),  # p·Σs <= ε keeps nothing
    (top_p(0.9, "linear"), [1, 3, 2], [0, 1, 2]),  # τ = 5.39: 3 + 2 falls short, all three are counted
    (top_p(0.8, "linear"), [1, 3, 2], [1, 2]),  # τ = 4.79: 3 + 2 reaches it
])
def test_reference_conformance_vectors(config, scores, kept):
    assert select_groups(np.array(scores, float), config) == kept


def test_smallest_linear_stops_at_a_zero_score_and_top_k_variants():
    smallest = SnrFilterConfig(value=0.5, filter_type="smallest")
    assert select_groups(np.array([2.0, 0.0, 1.0]), smallest) == []
    assert select_groups(np.array([3.0, 1.0, 2.0]), smallest) == [1, 2]  # τ = 2.99: 1 + 2 = 3
    top_k = SnrFilterConfig(strategy="top_k", value=0.5)
    assert select_groups(np.array([0.1, 0.4, 0.3, 0.2]), top_k) == [1, 2]
    assert select_groups(np.array([0.1, 0.4, 0.3, 0.2]), SnrFilterConfig(strategy="top_k", value=0.01)) == [1]
    assert select_groups(np.array([0.1, 0.4, 0.3]), SnrFilterConfig(strategy="top_k_abs", value=5)) == [0, 1, 2]
    min_p = SnrFilterConfig(strategy="min_p", value=0.5)
    assert select_groups(np.array([1.0, 4.0, 2.0, 1.9]), min_p) == [1, 2]
    assert select_groups(np.array([1.0, 4.0, 2.0]), SnrFilterConfig(strategy="min_p", value=0.5,
                                                                   filter_type="smallest")) == [0, 2]
    assert select_groups(np.array([0.0, 0.0]), SnrFilterConfig(strategy="top_k", value=1, include_zero=False)) == []


def test_reward_metric_and_reward_sum_metrics_as_the_reference_tests():
    rewards = np.array([[10.0, 11.0], [0.0, 5.0]])
    selection = SnrSelection(SnrFilterConfig(strategy="top_k", value=0.5, metric="reward"), rewards, rewards)
    assert selection.groups == [0] and selection.row_mask.tolist() == [True, True, False, False]
    rm = np.array([[3, 2], [1, 4], [2, 1], [1, 2], [2, 2], [1, 2], [0, 1], [0, 0]], float).sum(1).reshape(4, 2)
    selection = SnrSelection(SnrFilterConfig(strategy="top_k", value=0.5, metric="reward_sum"), rm, rm)
    assert selection.groups == [0, 2]
    assert selection.metrics["rollout/in_group_reward_sum"] == pytest.approx(6.0)
    assert selection.metrics["rollout/chosen_in_group_reward_sum"] == pytest.approx(8.5)
    assert selection.metrics["rollout/filter_kept_ratio"] == 0.5 and selection.kept_ratio == 0.5


def test_default_reward_std_metrics_noop_and_zero_count():
    rewards = np.array([[0.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
    std = rewards.std(axis=1, ddof=1)
    everything = SnrSelection(SnrFilterConfig(metric="reward_std"), rewards, rewards)  # alias, p = 1: no-op
    assert everything.groups == [0, 1, 2]
    assert everything.metrics["rollout/in_group_std"] == pytest.approx(std.mean())
    assert everything.metrics["rollout/filter_zero_count"] == 1.0
    np.testing.assert_allclose(everything.reward_std, np.repeat(std, 3))
    no_zero = SnrSelection(SnrFilterConfig(include_zero=False), rewards, rewards)  # "1.0" of the sweep: drops zeros
    assert no_zero.groups == [0, 2]
    assert no_zero.metrics["rollout/chosen_in_group_std"] == pytest.approx(std[[0, 2]].mean())
    empty = SnrSelection(SnrFilterConfig(value=0.9, include_zero=False), np.ones((2, 3)), np.ones((2, 3)))
    assert empty.groups == [] and empty.metrics["rollout/chosen_in_group_std"] == 0.0


def test_batch_adjustment_loss_scaling_and_soft_reweighting():
    rng = np.random.default_rng(0)
    rows = np.arange(10)
    copied = adjust_batch_size(rows, 8, "copy", rng)
    assert len(copied) == 16 and copied[:10].tolist() == rows.tolist() and set(copied[10:]) <= set(rows)
    assert len(set(copied[10:])) == 6  # without replacement when enough rows exist
    deleted = adjust_batch_size(rows, 8, "delete", rng)
    assert len(deleted) == 8 and np.all(np.diff(deleted) > 0)
    assert adjust_batch_size(np.arange(3), 8, "copy", rng).shape == (8,)  # 5 extra from 3 rows: with replacement
    with pytest.raises(ValueError, match="batch_adjust_mode"):
        adjust_batch_size(rows, 8, "pad", rng)
    assert filter_loss_scale("linear", 0.25) == 0.25 and filter_loss_scale("sqrt", 0.25) == 0.5
    assert filter_loss_scale("none", 0.25) == 1.0
    np.testing.assert_allclose(soft_reweight(np.array([0.5, 1.0, 0.0])), [0.5 / (1 + 1e-6), 1 / (1 + 1e-6), 0.0])


def test_bad_settings_name_the_key():
    with pytest.raises(ValueError, match="rollout_filter_strategy"):
        SnrFilterConfig(strategy="top_q")
    with pytest.raises(ValueError, match="rollout_filter_metric"):
        SnrFilterConfig(metric="variance")
    with pytest.raises(ValueError, match="rollout_filter_value"):
        SnrFilterConfig(value=float("nan"))
