"""Score normalisation and reward placement against plain NumPy (starpo.md §7, §8.2)."""

import jax
import numpy as np
import pytest

from starpo_jax.scores import (normalization_group_ids, normalize_scores, place_scores_on_last_token,
                               place_turn_scores)


def np_normalize(scores, penalty, groups, method):
    x = scores + penalty
    out = x.copy()
    members = {}
    for i, g in enumerate(groups):
        members.setdefault(int(g), []).append(i)
    if len(members) == len(x) or method == "identity":
        return x
    for idx in members.values():
        values = x[idx]
        mean = values.mean()
        std = values.std(ddof=1) if len(values) > 1 else float("nan")
        if method == "mean":
            out[idx] = values - mean
            continue
        normalized = (values - mean) / (std + 1e-6) if std > 1e-6 else np.zeros_like(values)
        out[idx] = np.clip(normalized, -1, 3) if method == "asym_clip" else normalized
    return out


@pytest.mark.parametrize("method", ["identity", "mean", "mean_std", "asym_clip"])
def test_normalize_scores_matches_numpy_per_state_group(method):
    rng = np.random.default_rng(0)
    groups = np.repeat(np.arange(4), 5)
    scores = rng.normal(size=20) * 3
    scores[5:10] = 1.0  # a zero-variance group normalises to 0
    penalty = -0.1 * rng.integers(0, 3, size=20)
    penalty[5:10] = 0.0
    out = jax.jit(normalize_scores, static_argnums=(3, 4))(scores, penalty, groups, 4, method)
    np.testing.assert_allclose(out, np_normalize(scores, penalty, groups, method), atol=1e-5)


def test_mean_std_hand_worked_values():
    # group [1, 2, 3]: mean 2, unbiased std 1 -> (x - 2) / (1 + 1e-6); group [5, 5]: std 0 -> 0
    out = normalize_scores(np.array([1.0, 2.0, 3.0, 5.0, 5.0]), np.zeros(5), np.array([0, 0, 0, 1, 1]), 2,
                           "mean_std")
    np.testing.assert_allclose(out, [-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6), 0.0, 0.0], atol=1e-6)


def test_asym_clip_clamps_to_minus_one_three():
    # 19 zeros and one 10: mean 0.5, unbiased var (19 * 0.25 + 9.5 ** 2) / 19 = 5;
    # the 10 maps to 9.5 / sqrt(5) = 4.25 -> clamped to 3, the zeros to -0.5 / sqrt(5)
    scores = np.array([0.0] * 19 + [10.0])
    out = np.asarray(normalize_scores(scores, np.zeros(20), np.zeros(20, int), 1, "asym_clip"))
    assert out[-1] == pytest.approx(3.0)
    np.testing.assert_allclose(out[:-1], -0.5 / (np.sqrt(5.0) + 1e-6), rtol=1e-5)
    below = np.asarray(normalize_scores(-scores, np.zeros(20), np.zeros(20, int), 1, "asym_clip"))
    assert below[-1] == pytest.approx(-1.0)


def test_penalty_added_first_and_normalisation_skipped_when_every_sample_is_its_own_group():
    scores = np.array([1.0, 0.0, 0.5])
    penalty = np.array([-0.1, 0.0, -0.2])
    out = normalize_scores(scores, penalty, np.arange(3), 3, "mean_std")
    np.testing.assert_allclose(out, scores + penalty, atol=1e-7)


def test_penalty_changes_the_normalised_value():
    scores = np.array([1.0, 1.0, 0.0, 0.0])
    with_penalty = normalize_scores(scores, np.array([0.0, -0.1, 0.0, 0.0]), np.zeros(4, int), 1, "mean")
    np.testing.assert_allclose(with_penalty, np.array([1.0, 0.9, 0.0, 0.0]) - 0.475, atol=1e-6)


@pytest.mark.parametrize("grouping", ["state", "batch", "inductive"])
def test_grouping_selects_the_group_ids(grouping):
    rng = np.random.default_rng(1)
    state_ids = np.repeat(np.arange(4), 3)
    tag_ids = np.repeat(np.array([0, 1]), 6)
    ids = np.asarray(normalization_group_ids(grouping, state_ids, tag_ids))
    expected = {"state": state_ids, "inductive": tag_ids, "batch": np.zeros(12, int)}[grouping]
    np.testing.assert_array_equal(ids, expected)
    scores = rng.normal(size=12)
    out = normalize_scores(scores, np.zeros(12), ids, 4, "mean_std")
    np.testing.assert_allclose(out, np_normalize(scores, np.zeros(12), ids, "mean_std"), atol=1e-5)


def test_unknown_method_and_grouping_name_the_field():
    with pytest.raises(ValueError, match="reward_normalization.method"):
        normalize_scores(np.zeros(2), np.zeros(2), np.zeros(2, int), 1, "zscore")
    with pytest.raises(ValueError, match="reward_normalization.grouping"):
        normalization_group_ids("env", np.zeros(2, int), np.zeros(2, int))


def test_place_scores_on_last_token():
    out = np.asarray(place_scores_on_last_token(np.array([0.5, -1.0]), 4))
    np.testing.assert_array_equal(out, [[0, 0, 0, 0.5], [0, 0, 0, -1.0]])


START, END, NL, PAD = 7, 8, 9, 0


def chat(turns):
    """system, user, (assistant, user)* as token ids; returns ids and the im_end position of each assistant."""
    ids = [START, 1, END, NL, START, 2, END, NL]
    ends = []
    for turn in range(turns):
        ids += [START, 3, 4, END]
        ends.append(len(ids) - 1)
        ids += [NL]
        if turn < turns - 1:
            ids += [START, 5, END, NL]
    return ids, ends


@pytest.mark.parametrize("shift", [0, 1])
def test_turn_scores_land_on_turn_ends_with_reference_shift(shift):
    rows = [chat(3), chat(2)]
    length = max(len(ids) for ids, _ in rows) + 2
    input_ids = np.full((2, length), PAD)
    offsets = []
    for r, (ids, _) in enumerate(rows):
        offsets.append(length - len(ids))
        input_ids[r, length - len(ids):] = ids
    indicators = np.cumsum(input_ids == START, axis=1)
    turn_scores = np.array([[0.5, -0.2, 1.0], [0.3, 0.7, 0.0]])
    out = np.asarray(place_turn_scores(input_ids, indicators, turn_scores, END, shift))
    assert out.shape == (2, length - 1)
    expected = np.zeros((2, length - 1))
    for r, (_, ends) in enumerate(rows):
        for k, pos in enumerate(ends):
            # input position p (+ shift) becomes aligned position p + shift - 1
            expected[r, offsets[r] + pos + shift - 1] = turn_scores[r, k]
    np.testing.assert_allclose(out, expected, atol=1e-7)


def test_turn_score_without_position_goes_to_last_column_or_wraps_away():
    ids, _ = chat(1)
    input_ids = np.array([ids])
    indicators = np.cumsum(input_ids == START, axis=1)
    turn_scores = np.array([[0.5, 2.0]])  # the second turn does not exist in the sequence
    unshifted = np.asarray(place_turn_scores(input_ids, indicators, turn_scores, END, 0))
    assert unshifted[0, -1] == pytest.approx(2.0)
    shifted = np.asarray(place_turn_scores(input_ids, indicators, turn_scores, END, 1))
    assert shifted.sum() == pytest.approx(0.5)
