"""RAGEN-2's environment metrics (ragen2.md §6.8) on a hand-played 2048 episode: episodic_return, max_tile,
final_score, with the numeric info values the host wrapper keeps."""

import jax.numpy as jnp
import numpy as np
import pytest

import envs
from bench.env_peers import Peer2048
from envs.game_2048 import Game2048State
from starpo_jax.env_manager import GymnaxHostEnv, reset_slot, run_turn, slot_metrics
from starpo_jax.trainer import env_metrics

START = [[2, 2, 4, 8], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
TURNS = [["Up"], ["Left", "Left"], ["Down"]]  # Up moves nothing: raw reward -0.1, no spawn


class Recorded(GymnaxHostEnv):
    """The host wrapper, recording the grid before each step and the info after it."""

    def step(self, action):
        self.grids.append(np.asarray(self.state.grid))
        out = super().step(action)
        self.infos.append(out[3])
        return out


@pytest.fixture(scope="module")
def played():
    env = Recorded(envs.make("game_2048", envs.CUSTOM_ENVS_V2))
    env.grids, env.infos = [], []
    slot = reset_slot(env, 0, 0, 0)
    env.state = Game2048State(jnp.asarray(START, jnp.int32), jnp.int32(0), jnp.int32(0))
    for actions in TURNS:
        run_turn(slot, "r", actions)
    names = [name for actions in TURNS for name in actions]
    raws = []
    for grid, name in zip(env.grids, names):  # the NumPy peer's move of the recorded grid
        _, merged, moved = Peer2048()._move(grid, env.action_names.index(name))
        raws.append(float(merged) if moved else float(np.float32(-0.1)))
    return slot, env, raws, env.infos


def test_host_wrapper_keeps_numeric_info_values(played):
    _, _, raws, infos = played
    assert infos[0]["action_is_valid"] is False and infos[0]["raw_reward"] == raws[0] == float(np.float32(-0.1))
    assert isinstance(infos[1]["score"], int) and isinstance(infos[1]["raw_reward"], float)
    assert [i["raw_reward"] for i in infos] == raws


def test_episodic_return_max_tile_and_final_score_of_a_hand_played_game(played):
    slot, env, raws, _ = played
    metrics = slot_metrics(slot)
    assert raws[:2] == [float(np.float32(-0.1)), 4.0]  # Up: nothing moves; Left: 2+2 merge
    assert metrics["episodic_return"] == sum(raws)
    assert metrics["final_score"] == sum(r for r in raws if r > 0) == float(env.state.score)
    assert metrics["max_tile"] == float(np.max(env.state.grid)) >= 8
    assert metrics["num_actions"] == 4.0 and metrics["action_is_valid"] == pytest.approx(2 / 3)
    assert slot.score == pytest.approx(sum(0.1 * np.log2(r + 1) for r in raws if r > 0))


def test_info_keys_are_averaged_over_turns_as_ragen2(played):
    slot, _, raws, infos = played
    metrics = slot_metrics(slot)
    last = np.cumsum([len(actions) for actions in TURNS]) - 1  # each turn's info is its last action's
    assert metrics["raw_reward"] == pytest.approx(sum(raws) / len(TURNS))  # a turn's raw rewards summed
    assert metrics["score"] == pytest.approx(sum(infos[i]["score"] for i in last) / len(TURNS))
    assert metrics["action_is_valid"] == pytest.approx(np.mean([infos[i]["action_is_valid"] for i in last]))
    assert "success" in metrics and metrics["success"] in (0.0, 1.0)


def test_trainer_logs_them_per_tag_with_ragens_reduction(played):
    slot, *_ = played
    rows = [slot_metrics(slot), {**slot_metrics(slot), "max_tile": 2.0, "episodic_return": 0.0},
            {"success": 1.0, "num_actions": 1.0}]
    out = env_metrics(rows, np.array([0, 0, 1]), np.array([1.0, 2.0, 3.0]), ("game_2048", "Bandit"), "train")
    assert out["train/game_2048/max_tile"] == rows[0]["max_tile"]  # max over trajectories
    assert out["train/game_2048/episodic_return"] == pytest.approx(rows[0]["episodic_return"] / 2)
    assert out["train/game_2048/final_score"] == rows[0]["final_score"]
    assert "train/Bandit/max_tile" not in out and out["train/Bandit/success"] == 1.0


def test_batch_metrics_average_tags_and_take_the_largest_tile():
    rows = [{"episodic_return": 3.0, "max_tile": 16.0}, {"episodic_return": 1.0, "max_tile": 64.0},
            {"episodic_return": 8.0}]
    out = env_metrics(rows, np.array([0, 0, 1]), np.zeros(3), ("game_2048", "Bandit"), "train")
    assert out["charts/avg_episode_return"] == pytest.approx(((3.0 + 1.0) / 2 + 8.0) / 2)  # per tag, then over tags
    assert out["rollout/max_tile"] == 64.0
    val = env_metrics(rows[2:], np.array([0]), np.zeros(1), ("Bandit",), "val")
    assert val == {**val, "val/charts/avg_episode_return": 8.0} and "val/rollout/max_tile" not in val
