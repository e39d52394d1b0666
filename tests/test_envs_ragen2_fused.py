"""2048, the 2x2 cube, CoordSokoban (grid_coord) and CoordFrozenLake (grid_coord, coord) in the fused driver: the
host driver's trajectories (greedy)."""

import dataclasses

import jax
import numpy as np
import pytest

import envs
from envs.text import env_prefix
from starpo_jax.env_manager import GymnaxHostEnv, reset_slot
from starpo_jax.fused_rollout import build_env_tables, fused_rollout, make_fused_rollout
from starpo_jax.models.kv_cache import init_cache
from starpo_jax.presets import load_config
from starpo_jax.rollout import RolloutSettings, host_rollout
from starpo_jax.sampler import make_sampler
from starpo_jax.trajectory import render_chat
from test_starpo_fused_rollout import assert_same, tiny_policy

TAGS = ("Short2048", "rubikscube", "CoordSokoban", "CoordFrozenLake", "CoordLakeXY")
ROWS = (2, 2, 2, 2, 2)
SEEDS = (3, 4, 5, 6, 7, 8, 9, 10, 11, 12)
RESPONSE = "go</think><answer>Up || U</answer>"  # one name is valid in each game, the other a format penalty
NEW_TOKENS = 12
SETTINGS = RolloutSettings(max_turn=2, max_model_len=1024, train_on_sampled_ids=True, bucket=1024,
                           max_actions_per_turn=2)
CUSTOM_ENVS = {**envs.CUSTOM_ENVS_V2,
               "Short2048": dataclasses.replace(envs.RAGEN2_ENVS["game_2048"], max_actions_per_traj=6, max_tokens=50),
               "CoordLakeXY": envs.EnvEntry.of_type("coord_frozen_lake", observation_format="coord")}


def make_slots():
    tags = [b for b, n in enumerate(ROWS) for _ in range(n)]
    return [reset_slot(GymnaxHostEnv(envs.make(TAGS[tag], CUSTOM_ENVS)), seed, group, tag)
            for group, (seed, tag) in enumerate(zip(SEEDS, tags))]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    slots = make_slots()
    corpus = [render_chat(s.prefix, s.history)[1]["content"] for s in slots] * 5 + [env_prefix(s.env) for s in slots]
    tokenizer, config, graphdef, _, params, sampler_config = tiny_policy(corpus, RESPONSE,
                                                                         tmp_path_factory.mktemp("tok"), NEW_TOKENS)
    tables = [build_env_tables(envs.make(t, CUSTOM_ENVS), tokenizer, SETTINGS) for t in TAGS]
    fused = make_fused_rollout(graphdef, config, sampler_config, tables, ROWS, tokenizer, SETTINGS)
    return dict(tokenizer=tokenizer, config=config, params=params, fused=fused,
                host_sampler=make_sampler(graphdef, sampler_config))


def test_fused_equals_host_on_2048_the_cube_coord_sokoban_and_coord_frozen_lake(setup):
    slots = make_slots()
    cache = init_cache(setup["config"], len(slots), SETTINGS.max_model_len + NEW_TOKENS)
    host = host_rollout(setup["host_sampler"], setup["params"], setup["tokenizer"], slots, cache, jax.random.key(7),
                        SETTINGS)
    out = fused_rollout(setup["fused"], setup["params"], setup["tokenizer"], SEEDS, range(len(SEEDS)),
                        jax.random.key(7))
    assert_same(*out, host, slots)
    assert all(s.num_actions > 0 for s in slots) and all(s.penalty < 0 for s in slots)
    text = setup["tokenizer"].decode(out.trajectory.input_ids[0])
    assert "Current 2048 Grid:" in text and text.count("<|im_start|>assistant\n<think>") >= 2
    assert np.mean([m["action_is_valid"] for m in out.metrics]) > 0
    assert "Max response length: 50 words (tokens)." in text  # Short2048's own max_tokens, not game_2048's 8192
    assert {"episodic_return", "max_tile", "final_score", "raw_reward", "score"} <= set(out.metrics[0])
    assert "max_tile" not in out.metrics[2]
    lake, xy = (setup["tokenizer"].decode(out.trajectory.input_ids[i]) for i in (6, 8))
    assert "Grid Map: \n" in lake and "Start: (" in lake and "Start: (" in xy and "Grid Map" not in xy


def test_v2_bandit_is_host_only(setup):
    with pytest.raises(ValueError, match="Bandit.*rollout_driver=host"):
        build_env_tables(envs.make("Bandit", envs.CUSTOM_ENVS_V2), setup["tokenizer"], SETTINGS)


def test_a_config_override_of_max_tokens_reaches_the_fused_tables(setup):
    """``custom_envs.<Tag>.max_tokens`` (RAGEN-2's per-tag announced response limit) through the config path."""
    config = load_config("v2-2048-starpo-s-ppo", ["custom_envs.game_2048.max_tokens=37",
                                                  "custom_envs.game_2048.max_actions_per_traj=2"])  # small tables
    settings = dataclasses.replace(SETTINGS, max_turn=2)
    tables = build_env_tables(envs.make("game_2048", config.custom_envs), setup["tokenizer"], settings)
    after = [setup["tokenizer"].decode(row[:n]) for row, n in zip(np.asarray(tables.after.ids),
                                                                  np.asarray(tables.after.lengths))]
    assert all("Max response length: 37 words (tokens)." in text for text in after)
