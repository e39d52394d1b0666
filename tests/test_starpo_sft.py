"""Supervised warm-up pieces: demonstrations in RAGEN's format, the masked SFT loss, the Echo Trap plot."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from envs.registry import CUSTOM_ENVS
from envs.text import parse_response
from runtime.config import split_section
from launch.demo_starpo import tokenizer_corpus
from starpo_jax.custom_envs import SECTION, apply_overrides
from starpo_jax.demonstrations import GUESS_THOUGHT, demonstrate
from starpo_jax.plots import ema, env_tags, plot_echo_trap, series
from starpo_jax.sft import SFTBatch, epoch_batches, sft_loss
from starpo_jax.trajectory import Trajectory


def test_bandit_demonstrations_pull_each_arm_half_the_time_in_ragen_format():
    slots = demonstrate("Bandit", range(40), max_turn=1)
    arms, chose_first_listed = [], []
    for slot in slots:
        parsed = parse_response(slot.history[0].llm_response)
        assert parsed.matched and slot.done and slot.penalty == 0
        arms.append(parsed.actions[0])
        chose_first_listed.append(arms[-1] == slot.history[0].state.split("named ")[1].split(" and")[0])
    assert arms.count("Dragon") == arms.count("Phoenix") == 20
    assert 0 < sum(chose_first_listed) < len(slots)
    assert np.mean([s.success for s in slots]) == 0.5


def test_frozen_lake_demonstrations_name_the_way_to_the_goal_and_head_there_each_turn():
    turns = 0
    for slot in demonstrate("FrozenLake", range(12), max_turn=3, actions_per_turn=2):
        for turn in slot.history[:len(slot.turn_infos)]:
            rows = turn.state.split("\n")
            (player_row, player_col), = [(r, row.index("P")) for r, row in enumerate(rows) if "P" in row]
            (goal_row, goal_col), = [(r, row.index("G")) for r, row in enumerate(rows) if "G" in row]
            words = [w for w, on in (("down", goal_row > player_row), ("up", goal_row < player_row),
                                     ("right", goal_col > player_col), ("left", goal_col < player_col)) if on]
            assert turn.llm_response == (f"<think>The goal is {words[0]}.</think>"
                                         f"<answer>{words[0].title()} || {words[0].title()}</answer>")
            turns += 1
    assert turns > 12


def test_coordinate_frozen_lake_demonstrations_head_for_the_goal_and_keep_their_states_in_the_tokenizer_corpus():
    """A subclass of FrozenLake (RAGEN-2's CoordFrozenLake, here under a tag of the user's) gets its demonstrator;
    coordinate-only states are text the tokenizer may learn, grid states stay out of its corpus."""
    keys = ["custom_envs.CoordLake.env_type=coord_frozen_lake", "custom_envs.CoordLake.env_config.success_rate=1"]
    coord, grid_coord = (apply_overrides(CUSTOM_ENVS, split_section(
        keys + [f"custom_envs.CoordLake.env_config.observation_format={fmt}"], SECTION)[0])
        for fmt in ("coord", "grid_coord"))
    turns = 0
    slots = demonstrate("CoordLake", range(12), max_turn=3, actions_per_turn=1, custom_envs=coord)
    for slot in slots:
        for turn in slot.history[:len(slot.turn_infos)]:
            lines = dict(line.split(": ", 1) for line in turn.state.split("\n")[1:])
            (player_row, player_col), (goal_row, goal_col) = (map(int, lines[k].strip("()").split(", "))
                                                              for k in ("Player", "Goal"))
            words = [w for w, on in (("down", goal_row > player_row), ("up", goal_row < player_row),
                                     ("right", goal_col > player_col), ("left", goal_col < player_col)) if on]
            assert turn.llm_response == f"<think>The goal is {words[0]}.</think><answer>{words[0].title()}</answer>"
            turns += 1
    assert turns > 12
    assert slots[0].history[0].state in tokenizer_corpus(slots[:1])[0]
    with_grid = demonstrate("CoordLake", [0], max_turn=1, actions_per_turn=1, custom_envs=grid_coord)
    assert "Grid Map" in with_grid[0].history[0].state and "Grid Map" not in tokenizer_corpus(with_grid)[0]


def test_guessed_turns_say_so_and_draw_their_actions_uniformly():
    played = [turn for slot in demonstrate("FrozenLake", range(80), max_turn=3, actions_per_turn=1, guess=0.5)
              for turn in slot.history[:len(slot.turn_infos)]]
    guessed = [parse_response(t.llm_response) for t in played if t.llm_response.startswith(f"<think>{GUESS_THOUGHT}<")]
    reasoned = [t for t in played if t.llm_response.startswith("<think>The goal is ")]
    assert len(guessed) + len(reasoned) == len(played) > 100
    assert 0.35 < len(guessed) / len(played) < 0.65
    assert all(p.matched and len(p.actions) == 1 for p in guessed)
    assert {p.actions[0] for p in guessed} == {"Left", "Down", "Right", "Up"}
    always = demonstrate("Bandit", range(6), max_turn=1, actions_per_turn=1, guess=1.0)
    assert all(s.history[0].llm_response.startswith(f"<think>{GUESS_THOUGHT}</think><answer>") for s in always)
    with pytest.raises(ValueError, match=r"guess must be in \[0, 1\]"):
        demonstrate("FrozenLake", [0], max_turn=1, guess=1.5)


def test_unknown_demonstrator_is_a_clear_error():
    with pytest.raises(ValueError, match="no demonstrator for environment tag 'SimpleSokoban'"):
        demonstrate("SimpleSokoban", [0], max_turn=1)


def test_sft_loss_is_the_masked_token_mean_nll():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
    ids = rng.integers(0, 7, (2, 5)).astype(np.int32)
    mask = np.array([[0, 1, 1, 0], [1, 0, 0, 1]], np.float32)
    loss, metrics = sft_loss(jnp.asarray(logits), SFTBatch(jnp.asarray(ids), jnp.ones((2, 5)), jnp.asarray(mask)))
    log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll, hits = [], []
    for b, j in zip(*np.nonzero(mask)):
        nll.append(-log_softmax[b, j, ids[b, j + 1]])
        hits.append(np.argmax(logits[b, j]) == ids[b, j + 1])
    np.testing.assert_allclose(float(loss), np.mean(nll), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["sft/accuracy"]), np.mean(hits), rtol=1e-5)


def test_epoch_batches_cover_every_demonstration_once_per_epoch():
    n = 6
    demos = Trajectory(np.arange(n)[:, None].repeat(3, 1), np.ones((n, 3)), None, np.ones((n, 2)), None, None,
                       None, None)
    batches = epoch_batches(demos, 3, np.random.default_rng(0))
    first_epoch = np.concatenate([next(batches).input_ids[:, 0] for _ in range(2)])
    assert sorted(first_epoch) == list(range(n))
    with pytest.raises(ValueError, match="6 demonstrations are fewer than the SFT batch size 8"):
        next(epoch_batches(demos, 8, np.random.default_rng(0)))
    with pytest.raises(ValueError, match="bucket and window must be >= 1, got bucket=0, window=16"):
        next(epoch_batches(demos, 3, np.random.default_rng(0), bucket=0))


def test_epoch_batches_group_by_length_and_cut_only_left_padding():
    rng = np.random.default_rng(1)
    n, width = 32, 40
    lengths = rng.integers(3, width + 1, n)
    attention = (np.arange(width)[None] >= width - lengths[:, None]).astype(np.int32)
    ids = np.where(attention, rng.integers(1, 50, (n, width)), 0)
    loss = attention[:, 1:] * rng.integers(0, 2, (n, width - 1))
    demos = Trajectory(ids, attention, None, loss, None, None, None, None)
    batches = epoch_batches(demos, 4, np.random.default_rng(0), bucket=8, window=8)
    seen, spreads = [], []
    for _ in range(n // 4):
        batch = next(batches)
        rows = [int(np.flatnonzero((ids == row).all(axis=1))[0]) for row in
                np.pad(batch.input_ids, ((0, 0), (width - batch.input_ids.shape[1], 0)))]
        longest = lengths[rows].max()
        assert batch.input_ids.shape[1] == min(width, -(-longest // 8) * 8)
        cut = width - batch.input_ids.shape[1]
        np.testing.assert_array_equal(batch.attention_mask, attention[rows, cut:])
        np.testing.assert_array_equal(batch.loss_mask, loss[rows, cut:])
        assert attention[rows, :cut].sum() == 0
        seen += rows
        spreads.append(np.ptp(lengths[rows]))
    assert sorted(seen) == list(range(n))
    shuffled = [np.ptp(lengths[rng.permutation(n)[:4]]) for _ in range(200)]
    assert np.mean(spreads) < 0.5 * np.mean(shuffled)


def test_echo_trap_plot_reads_every_panel_metric(tmp_path):
    rows = [{"step": 0, "val/Bandit/success": 0.5},
            *({"step": s, "train/Bandit/success": 0.1 * s, "train/Bandit/reward/mean": 0.2,
               "train/Bandit/reward/std": 0.1, "rollout/in_group_std": 0.3, "rollout/chosen_in_group_std": 0.4,
               "actor/grad_norm": "nan" if s == 2 else 1.0, "critic/grad_norm": 2.0, "actor/entropy_loss": 0.6,
               "actor/pg_clipfrac": 0.0, "actor/ppo_kl": 0.0} for s in (1, 2, 3)),
            *({"step": s, **{f"collapse_{f}_sample/{k}": 0.5 for f in ("first_turn", "trajectory")
                             for k in ("retrieval_accuracy", "retrieval_chance_level", "mi_zscore_ema",
                                       "conditional_entropy_est")}} for s in (1, 3))]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert env_tags(rows) == ["Bandit"]
    steps, values = series(rows, "actor/grad_norm")
    assert steps.tolist() == [1, 3] and values.tolist() == [1.0, 1.0]
    plotted = plot_echo_trap(path, tmp_path / "panel.png")
    assert set(plotted) == {name for row in rows for name in row} - {"step"}
    assert (tmp_path / "panel.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ema_matches_hand_worked_values():
    np.testing.assert_allclose(ema(np.array([1.0, 0.0, 1.0]), weight=0.5), [1.0, 0.5, 0.75])
