"""Sudoku in the fused driver: free-text moves parsed on device as the host parses them, the ``with_feedback`` text
rendered as the host's token ids (the echo of an unparseable action included), fused == host trajectories."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs
from envs.sudoku import parse_move
from envs.text import env_prefix, parse_response
from starpo_jax.env_manager import reset_slot
from starpo_jax.fused_rollout import build_env_tables, fused_rollout, make_fused_rollout
from starpo_jax.models.kv_cache import init_cache
from starpo_jax.presets import load_config
from starpo_jax.rollout import RolloutSettings, host_rollout
from starpo_jax.sampler import make_sampler
from starpo_jax.trajectory import render_chat
from test_starpo_fused_rollout import assert_same, tiny_policy

TAGS = ("TinySudoku",)
SEEDS = (3, 4, 5)
# A move (pattern 3; tab and newline keep the chain's tokens distinct), then a piece no pattern parses: the next
# state echoes it ("Could not parse action: 'Up'").
RESPONSE = "go</think><answer>place\t3 at\n1,2 || Up</answer>"
NEW_TOKENS = 16
SETTINGS = RolloutSettings(max_turn=2, max_model_len=1024, train_on_sampled_ids=True, bucket=1024,
                           max_actions_per_turn=2)
CUSTOM_ENVS = {**envs.CUSTOM_ENVS_V2, "TinySudoku": envs.EnvEntry.of_type("sudoku", grid_size=4)}
ANSWERS = ["place 5 at row 2 col 3 || 2,3,5 || Up || 9,9,10 || (1, 2,  3)", "I place 3 at (1,2)",
           "5 at 1, 2 || at 12,3,4 || 003,1,2", "PLACE 4 AT ROW 1 COL 1", " || 1,2 ||| 3,4,5",
           "place  3   at  row 2 col 3x || row 1, 2, 3 || (1,2,3) || place 1 at 2, 3", "4,4,4||0,1,1||1,2,3||1,1,1"]


def make_slots():
    return [reset_slot(envs.make(TAGS[0], CUSTOM_ENVS), seed, group, 0) for group, seed in enumerate(SEEDS)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    slots = make_slots()
    corpus = [render_chat(s.prefix, s.history)[1]["content"] for s in slots] * 5 + [env_prefix(slots[0].env)]
    corpus += [f"<answer>{answer}</answer>" for answer in ANSWERS] * 5
    tokenizer, config, graphdef, _, params, sampler_config = tiny_policy(corpus, RESPONSE,
                                                                         tmp_path_factory.mktemp("tok"), NEW_TOKENS)
    tables = build_env_tables(envs.make(TAGS[0], CUSTOM_ENVS), tokenizer, SETTINGS)
    fused = make_fused_rollout(graphdef, config, sampler_config, [tables], (len(SEEDS),), tokenizer, SETTINGS)
    return dict(tokenizer=tokenizer, config=config, params=params, fused=fused, tables=tables,
                host_sampler=make_sampler(graphdef, sampler_config))


def test_the_device_parser_gives_the_host_moves(setup):
    tokenizer, parser, n = setup["tokenizer"], setup["tables"].parser, 4
    texts = [f"x</think><answer>{answer}</answer>" for answer in ANSWERS] + ["no answer"]
    ids = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    batch = np.zeros((len(ids), max(map(len, ids))), np.int32)
    for i, row in enumerate(ids):
        batch[i, :len(row)] = row
    out = jax.jit(jax.vmap(parser.parse, (0, 0, None)))(jnp.asarray(batch), jnp.asarray([len(r) for r in ids]), 3)
    for k, row in enumerate(ids):
        actions = parse_response("<think>" + tokenizer.decode(row), True, 2).actions
        moves = [parse_move(action, n) for action in actions]
        want = [n ** 3 + 1 if isinstance(m, str) and m.startswith("Could") else n ** 3 if isinstance(m, str)
                else ((m[0] - 1) * n + m[1] - 1) * n + m[2] - 1 for m in moves]
        assert [int(a) for a in np.asarray(out.action_ids[k]) if a >= 0] == want, texts[k]
        echo = bytes(np.asarray(out.context[0][k])[:int(out.context[1][k])]).decode()
        assert echo == (actions[-1] if actions else ""), texts[k]
        assert bool(out.format_penalty[k]) == (not actions)


def test_fused_equals_host_on_sudoku(setup):
    slots = make_slots()
    cache = init_cache(setup["config"], len(slots), SETTINGS.max_model_len + NEW_TOKENS)
    host = host_rollout(setup["host_sampler"], setup["params"], setup["tokenizer"], slots, cache, jax.random.key(7),
                        SETTINGS)
    out = fused_rollout(setup["fused"], setup["params"], setup["tokenizer"], SEEDS, range(len(SEEDS)),
                        jax.random.key(7))
    assert_same(*out, host, slots)
    text = setup["tokenizer"].decode(out.trajectory.input_ids[0])
    assert "SUDOKU PUZZLE" in text and "Could not parse action: 'Up'" in text
    assert all(s.num_actions == 4 for s in slots)


def test_sudoku_runs_on_the_fused_driver_and_16x16_names_the_limit(setup):
    config = load_config("v2-sudoku-starpo-s-ppo", ["agent_proxy.rollout_driver=fused", "train_on_sampled_ids=True"])
    assert config.agent_proxy.rollout_driver == "fused"
    big = envs.make("SimpleSudoku", envs.CUSTOM_ENVS_V2, grid_size=16)
    with pytest.raises(ValueError, match="grid_size=16 has no on-device renderer.*rollout_driver=host"):
        build_env_tables(big, setup["tokenizer"], dataclasses.replace(SETTINGS, max_turn=1))
