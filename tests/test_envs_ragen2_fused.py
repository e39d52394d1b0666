"""2048, the 2x2 cube, CoordSokoban (grid_coord), CoordFrozenLake (grid_coord, coord with the goal offset) and Sudoku (free-text moves)
in the fused driver: the host driver's trajectories (greedy); Sudoku's on-device parser gives the host's moves."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

import pytest

import envs
from envs.base import TextEnvironment
from envs.sudoku import parse_move
from envs.text import env_prefix, parse_response
from envs.text_pieces import piece_tables
from starpo_jax.env_manager import GymnaxHostEnv, reset_slot
from starpo_jax.fused_rollout import build_env_tables, fused_rollout, make_fused_rollout
from starpo_jax.models.kv_cache import init_cache
from starpo_jax.presets import load_config
from starpo_jax.rollout import RolloutSettings, host_rollout
from starpo_jax.sampler import make_sampler
from starpo_jax.trajectory import render_chat
from test_starpo_fused_rollout import assert_same, tiny_policy

TAGS = ("Short2048", "rubikscube", "CoordSokoban", "CoordFrozenLake", "CoordLakeXY", "TinySudoku")
ROWS = (2, 2, 2, 2, 2, 2)
SEEDS = (3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14)
# "Up" is valid in 2048, Sokoban and FrozenLake, "U" in the cube, the rest a format penalty there. Sudoku: a move
# (pattern 3; tab and newline keep the chain's tokens distinct), then two pieces no pattern parses, the last echoed
# by the next state ("Could not parse action: 'Up'").
RESPONSE = "go</think><answer>place\t3 at\n1,2 || U||Up</answer>"
NEW_TOKENS = 18
SETTINGS = RolloutSettings(max_turn=2, max_model_len=1024, train_on_sampled_ids=True, bucket=1024,
                           max_actions_per_turn=3)
CUSTOM_ENVS = {**envs.CUSTOM_ENVS_V2,
               "Short2048": dataclasses.replace(envs.RAGEN2_ENVS["game_2048"], max_actions_per_traj=6, max_tokens=50),
               "CoordLakeXY": envs.EnvEntry.of_type("coord_frozen_lake", observation_format="coord", goal_offset=True),
               "TinySudoku": envs.EnvEntry.of_type("sudoku", grid_size=4)}
ANSWERS = ["place 5 at row 2 col 3 || 2,3,5 || Up || 9,9,10 || (1, 2,  3)", "I place 3 at (1,2)",
           "5 at 1, 2 || at 12,3,4 || 003,1,2", "PLACE 4 AT ROW 1 COL 1", " || 1,2 ||| 3,4,5",
           "place  3   at  row 2 col 3x || row 1, 2, 3 || (1,2,3) || place 1 at 2, 3", "4,4,4||0,1,1||1,2,3||1,1,1",
           # \d and \s beyond ASCII
           "\u0663,1,2 || place \uff13 at row 1 col 2 || 0\u0662,2,2", "1\u00a0at\u20034,\u06610"]


def make_slots():
    tags = [b for b, n in enumerate(ROWS) for _ in range(n)]
    made = [envs.make(TAGS[tag], CUSTOM_ENVS) for tag in tags]
    return [reset_slot(GymnaxHostEnv(env) if isinstance(env, TextEnvironment) else env, seed, group, tag)
            for group, (seed, tag, env) in enumerate(zip(SEEDS, tags, made))]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    slots = make_slots()
    corpus = [render_chat(s.prefix, s.history)[1]["content"] for s in slots] * 5 + [env_prefix(s.env) for s in slots]
    corpus += [f"<answer>{answer}</answer>" for answer in ANSWERS] * 5
    tokenizer, config, graphdef, _, params, sampler_config = tiny_policy(corpus, RESPONSE,
                                                                         tmp_path_factory.mktemp("tok"), NEW_TOKENS)
    tables = [build_env_tables(envs.make(t, CUSTOM_ENVS), tokenizer, SETTINGS) for t in TAGS]
    fused = make_fused_rollout(graphdef, config, sampler_config, tables, ROWS, tokenizer, SETTINGS)
    return dict(tokenizer=tokenizer, config=config, params=params, fused=fused, tables=tables,
                host_sampler=make_sampler(graphdef, sampler_config))


def test_fused_equals_host_on_2048_the_cube_coord_sokoban_coord_frozen_lake_and_sudoku(setup):
    slots = make_slots()
    cache = init_cache(setup["config"], len(slots), SETTINGS.max_model_len + NEW_TOKENS)
    host = host_rollout(setup["host_sampler"], setup["params"], setup["tokenizer"], slots, cache, jax.random.key(7),
                        SETTINGS)
    out = fused_rollout(setup["fused"], setup["params"], setup["tokenizer"], SEEDS, range(len(SEEDS)),
                        jax.random.key(7))
    assert_same(*out, host, slots)
    assert all(s.num_actions > 0 for s in slots) and all(s.penalty < 0 for s in slots[:10])
    text = setup["tokenizer"].decode(out.trajectory.input_ids[0])
    assert "Current 2048 Grid:" in text and text.count("<|im_start|>assistant\n<think>") >= 2
    assert np.mean([m["action_is_valid"] for m in out.metrics]) > 0
    assert "Max response length: 50 words (tokens)." in text  # Short2048's own max_tokens, not game_2048's 8192
    assert {"episodic_return", "max_tile", "final_score", "raw_reward", "score"} <= set(out.metrics[0])
    assert "max_tile" not in out.metrics[2]
    lake, xy, sudoku = (setup["tokenizer"].decode(out.trajectory.input_ids[i]) for i in (6, 8, 10))
    assert "Grid Map: \n" in lake and "Start: (" in lake and "Start: (" in xy and "Grid Map" not in xy
    assert "SUDOKU PUZZLE" in sudoku and "Could not parse action: 'Up'" in sudoku
    assert slots[10].num_actions == 6 and slots[10].penalty == 0  # every piece is an action, none a penalty


def test_the_sudoku_device_parser_gives_the_host_moves(setup):
    tokenizer, parser, n = setup["tokenizer"], setup["tables"][-1].parser, 4
    texts = [f"x</think><answer>{answer}</answer>" for answer in ANSWERS] + ["no answer"]
    ids = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    batch = np.zeros((len(ids), max(map(len, ids))), np.int32)
    for i, row in enumerate(ids):
        batch[i, :len(row)] = row
    out = jax.jit(jax.vmap(parser.parse, (0, 0, None)))(jnp.asarray(batch), jnp.asarray([len(r) for r in ids]), 5)
    for k, row in enumerate(ids):
        actions = parse_response("<think>" + tokenizer.decode(row), True, 3).actions
        moves = [parse_move(action, n) for action in actions]
        want = [n ** 3 + 1 if isinstance(m, str) and m.startswith("Could") else n ** 3 if isinstance(m, str)
                else ((m[0] - 1) * n + m[1] - 1) * n + m[2] - 1 for m in moves]
        assert [int(a) for a in np.asarray(out.action_ids[k]) if a >= 0] == want, texts[k]
        echo = bytes(np.asarray(out.context[0][k])[:int(out.context[1][k])]).decode()
        assert echo == (actions[-1] if actions else ""), texts[k]
        assert bool(out.format_penalty[k]) == (not actions)


def test_the_16x16_sudoku_renderer_gives_the_tokenizer_encoding(setup):
    """16x16 tables (one slot per cell, cut after its value; one- and two-digit values, boxes of four; 4x4 runs
    in the fused == host test): ``state_renderer`` checks them on sample states (feedback of every kind,
    valid-number lines, echoes) against the whole-text encoding, and raises otherwise."""
    env = envs.make("SimpleSudoku", envs.CUSTOM_ENVS_V2, grid_size=16).device_env()
    renderer = env.state_renderer(setup["tokenizer"], env.default_params, env.max_actions_per_traj, num_checks=8)
    obs, state = env.reset_env(jax.random.key(0), env.default_params)
    ids, length = renderer.tokens(obs)
    text = env.render_text(state)
    assert setup["tokenizer"].decode(ids[:length]) == text + "\n"
    assert "| " in text and ("[16]" in text or " 16 " in text) and "[1]" in text


@pytest.mark.parametrize("observation_format", ["grid_coord", "coord"])
def test_two_box_coord_sokoban_renders_its_coordinate_lists_on_device(setup, observation_format):
    """Multi-box coordinate lines (``Boxes: (1, 2), (3, 4)``): the tables are checked on rooms with boxes and the
    player on and off targets when built, and a generated level's tokens are its text's encoding."""
    env = envs.make("CoordSokoban", envs.CUSTOM_ENVS_V2, num_boxes=2, observation_format=observation_format)
    renderer = env.state_renderer(setup["tokenizer"], env.default_params, env.max_actions_per_traj, num_checks=24)
    obs, state = env.reset_env(jax.random.key(3), env.default_params)
    ids, length = renderer.tokens(obs)
    text = env.render_text(state)
    assert setup["tokenizer"].decode(ids[:length]) == text + "\n"
    assert len(re.findall(r"\(\d, \d\)", text)) == 5 and ("Grid Map" in text) == (observation_format == "grid_coord")


def test_a_piece_rendered_state_is_as_wide_as_its_longest_text(setup):
    """The ids of a piece-rendered state have room for each slot's longest variant, summed, not for every slot at
    the widest variant of all (the padding every turn's prefill would pay for)."""
    tokenizer = setup["tokenizer"]
    slots = [["Goal: (1, 2)\n", "G"], ["", " (0, 1),", " (0, 1)\n"], [" (3, 3)\n"]]
    renderer = piece_tables(tokenizer, slots, lambda obs: obs)
    longest = [max(len(tokenizer.encode(text, add_special_tokens=False)) for text in slot) for slot in slots]
    assert renderer.width == sum(longest) < len(slots) * renderer.ids.shape[1]
    ids, length = renderer.tokens(jnp.array([0, 2, 0]))
    assert ids.shape == (sum(longest),)
    assert tokenizer.decode(ids[:length]) == "Goal: (1, 2)\n (0, 1)\n (3, 3)\n"


def test_v2_bandit_is_host_only_and_sudoku_is_not(setup):
    with pytest.raises(ValueError, match="Bandit.*rollout_driver=host"):
        build_env_tables(envs.make("Bandit", envs.CUSTOM_ENVS_V2), setup["tokenizer"], SETTINGS)
    config = load_config("v2-sudoku-starpo-s-ppo", ["agent_proxy.rollout_driver=fused", "train_on_sampled_ids=True"])
    assert config.agent_proxy.rollout_driver == "fused"  # no longer refused as host-only


def test_a_config_override_of_max_tokens_reaches_the_fused_tables(setup):
    """``custom_envs.<Tag>.max_tokens`` (RAGEN-2's per-tag announced response limit) through the config path."""
    config = load_config("v2-2048-starpo-s-ppo", ["custom_envs.game_2048.max_tokens=37",
                                                  "custom_envs.game_2048.max_actions_per_traj=2"])  # small tables
    settings = dataclasses.replace(SETTINGS, max_turn=2)
    tables = build_env_tables(envs.make("game_2048", config.custom_envs), setup["tokenizer"], settings)
    after = [setup["tokenizer"].decode(row[:n]) for row, n in zip(np.asarray(tables.after.ids),
                                                                  np.asarray(tables.after.lengths))]
    assert all("Max response length: 37 words (tokens)." in text for text in after)
