"""StarPO-S group filter against a plain NumPy ranking (starpo.md §11, §22.12-13)."""

import jax
import numpy as np
import pytest

from starpo_jax.filtering import filter_groups_by_reward_std, num_kept_groups


def np_filter(scores, ratio, filter_type):
    groups = scores.shape[0]
    stds = [np.std(scores[g], ddof=1) for g in range(groups)]
    k = int(ratio * groups)
    if filter_type == "std":
        order = sorted(range(groups), key=lambda g: (-stds[g], g))
    else:
        order = sorted(range(groups), key=lambda g: (stds[g], g))
    return sorted(order[:k]), np.array(stds)


@pytest.mark.parametrize("ratio,filter_type", [(0.25, "std"), (0.5, "std_rev"), (0.75, "std"), (1.0, "std_rev"),
                                               (0.5, "std")])
def test_filter_keeps_groups_ranked_by_std(ratio, filter_type):
    rng = np.random.default_rng(int(ratio * 100))
    scores = rng.normal(size=(8, 4)) * rng.uniform(0.1, 2.0, size=(8, 1))
    scores[3] = 0.5  # a zero-variance group
    result = filter_groups_by_reward_std(scores, ratio, filter_type)
    kept, stds = np_filter(scores, ratio, filter_type)
    np.testing.assert_array_equal(result.group_indices, kept)
    expected_rows = [g * 4 + n for g in kept for n in range(4)]
    np.testing.assert_array_equal(result.sample_indices, expected_rows)
    keep = np.zeros(32)
    keep[expected_rows] = 1
    np.testing.assert_array_equal(result.keep_mask, keep)
    np.testing.assert_array_equal(result.sample_mask, np.ones(len(expected_rows)))
    metrics = {k: float(v) for k, v in result.metrics.items()}
    assert metrics["rollout/in_group_std"] == pytest.approx(stds.mean(), rel=1e-5)
    assert metrics["rollout/in_group_max"] == pytest.approx(scores.max(1).mean(), rel=1e-5)
    assert metrics["rollout/in_group_mean"] == pytest.approx(scores.mean(1).mean(), rel=1e-5, abs=1e-6)
    assert metrics["rollout/chosen_in_group_std"] == pytest.approx(stds[kept].mean(), rel=1e-5)
    assert metrics["rollout/chosen_in_group_max"] == pytest.approx(scores[kept].max(1).mean(), rel=1e-5)
    assert metrics["rollout/chosen_in_group_mean"] == pytest.approx(scores[kept].mean(1).mean(), rel=1e-5,
                                                                    abs=1e-6)


def test_ties_break_by_group_id_and_zero_std_groups_fill_or_drop():
    # stds: g0 = 0, g1 = std(0, 1), g2 = 0, g3 = 0; keep 2 -> g1 then the lowest-id zero group g0
    scores = np.array([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [2.0, 2.0]])
    result = filter_groups_by_reward_std(scores, 0.5, "std")
    np.testing.assert_array_equal(result.group_indices, [0, 1])
    np.testing.assert_array_equal(result.sample_mask, [1, 1, 1, 1])
    dropped = filter_groups_by_reward_std(scores, 0.5, "std", drop_zero_std=True)
    np.testing.assert_array_equal(dropped.group_indices, [0, 1])
    np.testing.assert_array_equal(dropped.sample_mask, [0, 0, 1, 1])
    np.testing.assert_array_equal(dropped.keep_mask, [0, 0, 1, 1, 0, 0, 0, 0])
    reverse = filter_groups_by_reward_std(scores, 0.5, "std_rev")
    np.testing.assert_array_equal(reverse.group_indices, [0, 2])


def test_filter_is_jittable_with_static_ratio_and_gathers_static_shapes():
    scores = np.random.default_rng(1).normal(size=(8, 16))
    run = jax.jit(lambda s: filter_groups_by_reward_std(s, 0.25, "std"))
    result = run(scores)
    assert result.sample_indices.shape == (32,)  # 8 x 16 x 0.25 = one mini-batch of 32
    batch = np.arange(128) * 10
    np.testing.assert_array_equal(batch[np.asarray(result.sample_indices)],
                                  batch[np.asarray(result.keep_mask) > 0])
    assert num_kept_groups(8, 0.25) == 2 and num_kept_groups(8, 0.75) == 6


def test_bad_filter_arguments_name_the_field():
    scores = np.zeros((4, 2))
    with pytest.raises(ValueError, match="rollout_filter_type"):
        filter_groups_by_reward_std(scores, 0.5, "max_mean")
    with pytest.raises(ValueError, match="rollout_filter_ratio"):
        filter_groups_by_reward_std(scores, 0.1, "std")
    with pytest.raises(ValueError, match="rollout_filter_ratio"):
        filter_groups_by_reward_std(scores, 1.5, "std")
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        filter_groups_by_reward_std(np.zeros((4, 1)), 0.5, "std")
    single = filter_groups_by_reward_std(np.arange(4.0)[:, None], 1.0, "std")
    np.testing.assert_array_equal(single.keep_mask, np.ones(4))
    assert float(single.metrics["rollout/in_group_std"]) == 0.0
    assert float(single.metrics["rollout/in_group_mean"]) == pytest.approx(1.5)
