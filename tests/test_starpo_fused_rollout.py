"""The fused on-device rollout equals the host driver (greedy, same seeds); its reward-text automaton."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import envs
from envs.text import reward_text
from runtime.mesh import MeshConfig, make_mesh
from runtime.sharding import shard_state
from starpo_jax.chat_tokenizer import CHATML_TEMPLATE, SPECIAL_TOKENS, TAG_TOKENS, train_chat_tokenizer
from starpo_jax.config import StarPOConfig, resolve, validate
from starpo_jax.env_manager import GymnaxHostEnv, reset_slot, slot_metrics
from starpo_jax.fused_rollout import build_env_tables, build_reward_table, fused_rollout, make_fused_rollout
from starpo_jax.models.config import TransformerConfig
from starpo_jax.models.kv_cache import init_cache
from starpo_jax.models.transformer import CausalLM
from starpo_jax.rollout import RolloutSettings, host_rollout
from starpo_jax.sampler import SamplerConfig, make_sampler
from starpo_jax.trajectory import render_chat

TAGS = ("Bandit", "FrozenLake", "ShortLake")
ROWS = (3, 3, 2)
SEEDS = (11, 12, 13, 62, 107, 23, 24, 25)  # moving Left, FrozenLake 62 and 107 reach the goal in turns 2 and 3
RESPONSE = "go</think><answer>Left || Dragon</answer>"
NEW_TOKENS = 12
SETTINGS = RolloutSettings(max_turn=3, max_model_len=768, train_on_sampled_ids=True, bucket=256)
# A new custom_envs tag: FrozenLake with a budget of 2 actions (under max_turn=3 turns of one action), max_tokens 50.
CUSTOM_ENVS = {**envs.CUSTOM_ENVS, "ShortLake": dataclasses.replace(envs.CUSTOM_ENVS["FrozenLake"],
                                                                   max_actions_per_traj=2, max_tokens=50)}


def chain_params(params, response_ids, config):
    """A context-free model (attention and MLP outputs zeroed) whose greedy chain is ``response_ids``.

    The head column of each successor is its predecessor's embedding, so token ``a`` scores its
    successor ``|e_a|^2`` and every other chain token ``e_a . e_b`` (random, smaller).
    """
    rng = np.random.default_rng(0)
    embed = rng.standard_normal((config.vocab_size, config.hidden_size)).astype(np.float32)
    head = np.zeros((config.hidden_size, config.vocab_size), np.float32)
    for before, after in zip(response_ids[:-1], response_ids[1:]):
        head[:, after] = embed[before]

    def edit(path, variable):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if "o_proj" in name or "down_proj" in name:
            return variable.replace(jnp.zeros_like(variable.get_value()))
        if "embed_tokens" in name:
            return variable.replace(jnp.asarray(embed))
        if "lm_head" in name:
            return variable.replace(jnp.asarray(head))
        return variable

    return jax.tree.map_with_path(edit, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    corpus = [render_chat(slot.prefix, slot.history)[1]["content"] for slot in make_slots()] * 5
    tokenizer = train_chat_tokenizer(corpus + [f"<think>{RESPONSE}"] * 20, tmp_path_factory.mktemp("tok"),
                                     vocab_size=1024)
    config = TransformerConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2,
                               num_heads=4, num_kv_heads=2, head_dim=8)
    with nnx.use_eager_sharding(False):
        graphdef, params = nnx.split(CausalLM(config, rngs=nnx.Rngs(0)))
    chain = [tokenizer.convert_tokens_to_ids("<think>")] + tokenizer.encode(RESPONSE) + [tokenizer.eos_token_id]
    assert len(set(chain)) == len(chain), "the chain model needs distinct tokens"
    sampler_config = SamplerConfig(max_new_tokens=NEW_TOKENS, greedy=True, stop_ids=(tokenizer.eos_token_id,),
                                   pad_id=tokenizer.pad_token_id)
    tables = [build_env_tables(envs.make(t, CUSTOM_ENVS), tokenizer, SETTINGS) for t in TAGS]
    mesh = make_mesh(MeshConfig(2, 4, 1))
    fused = make_fused_rollout(graphdef, config, sampler_config, tables, ROWS, tokenizer, SETTINGS, mesh)
    return dict(tokenizer=tokenizer, config=config, graphdef=graphdef, random=params,
                chain=chain_params(params, chain, config), tables=tables, fused=fused, mesh=mesh,
                host_sampler=make_sampler(graphdef, sampler_config), sampler_config=sampler_config)


def tag_ids():
    return [b for b, n in enumerate(ROWS) for _ in range(n)]


def make_slots():
    return [reset_slot(GymnaxHostEnv(envs.make(TAGS[tag], CUSTOM_ENVS)), seed, group, tag)
            for group, (seed, tag) in enumerate(zip(SEEDS, tag_ids()))]


def play_host(s, params, settings=SETTINGS):
    slots = make_slots()
    cache = init_cache(s["config"], len(slots), settings.max_model_len + NEW_TOKENS)
    traj = host_rollout(s["host_sampler"], params, s["tokenizer"], slots, cache, jax.random.key(7), settings)
    return traj, slots


def play_fused(s, params, settings=SETTINGS):
    """The fused driver with the batch sharded over 8 devices (data 2 x fsdp 4).

    ``settings`` may differ from the compiled ones only in ``use_turn_scores``, which the
    program does not read, so every call shares the fixture's compile.
    """
    program = s["fused"]._replace(settings=settings)
    with jax.set_mesh(s["mesh"]):
        return fused_rollout(program, shard_state(params, s["mesh"]), s["tokenizer"], SEEDS, range(len(SEEDS)),
                             jax.random.key(7))


def assert_same(traj, metrics, host_traj, slots):
    for name, a, b in zip(host_traj._fields, traj, host_traj):
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert metrics == [slot_metrics(slot) for slot in slots]


@pytest.mark.parametrize("weights,use_turn_scores", [("chain", True), ("random", False)])
def test_fused_on_eight_devices_equals_host_on_bandit_and_frozen_lake(setup, weights, use_turn_scores):
    settings = dataclasses.replace(SETTINGS, use_turn_scores=use_turn_scores)
    host_traj, slots = play_host(setup, setup[weights], settings)
    out = play_fused(setup, setup[weights], settings)
    assert_same(*out, host_traj, slots)
    assert (out.trajectory.turn_rewards is not None) == use_turn_scores
    text = setup["tokenizer"].decode(out.trajectory.input_ids[-1])
    if weights == "chain":  # actions run, rows end at different turns, a Bandit pull succeeds
        assert f"<think>{RESPONSE}<|im_end|>" in text
        assert any(s.num_actions > 0 for s in slots[ROWS[0]:]) and slots[0].success
        assert len({len(s.history) for s in slots}) > 1 and all(s.penalty < 0 for s in slots)
        short = [(row["num_actions"], s.truncated, len(s.history)) for row, s in zip(out.metrics, slots)][-ROWS[2]:]
        assert short == [(2.0, True, 3)] * ROWS[2]  # one action a turn: the budget ends ShortLake after turn 2
        assert "You can make up to 2 actions" in text and "Max response length: 50 words" in text
        assert [s.turn_scores for s in slots[2:5]] == [[1.0], [0.0, 1.0], [0.0, 0.0, 1.0]]
    else:  # responses hit the length cap without the turn end: the driver closes them
        assert text.count("<|im_start|>assistant\n<think>") == SETTINGS.max_turn
        assert all(s.num_actions == 0 and len(s.history) == SETTINGS.max_turn + 1 for s in slots)


def test_reward_automaton_spells_python_sums():
    env = envs.make("SimpleSokoban")
    params = env.default_params
    table, texts = build_reward_table(env, params, _ByteTokenizer(), max_steps=5)
    values = np.asarray(table.values)
    rng = np.random.default_rng(0)
    for _ in range(200):
        steps = rng.integers(0, len(values), rng.integers(0, 6))
        state = 0
        for v in steps:
            state = int(table.next_total[state, v])
        rewards = [env.reward_value(float(values[v]), params) for v in steps]
        assert texts[state] == reward_text(rewards) and table.totals[state] == np.float32(sum(rewards))
    assert texts[0] == "Reward:\n0\n" and "Reward:\n-0.30000000000000004\n" in texts


class _ByteTokenizer:
    """Encodes text as its UTF-8 bytes (the automaton test needs only some encoding)."""

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [list(t.encode()) for t in texts]}


def test_host_only_environments_and_rendered_training_text_are_refused(setup):
    with pytest.raises(ValueError, match="Countdown.*rollout_driver=host"):
        build_env_tables(envs.make("Countdown"), setup["tokenizer"], SETTINGS)
    with pytest.raises(ValueError, match="train_on_sampled_ids=True"):
        make_fused_rollout(setup["graphdef"], setup["config"], setup["sampler_config"], setup["tables"], ROWS,
                           setup["tokenizer"], dataclasses.replace(SETTINGS, train_on_sampled_ids=False))
    fused = dataclasses.replace(resolve(StarPOConfig()), train_on_sampled_ids=True, agent_proxy=dataclasses.replace(
        StarPOConfig().agent_proxy, rollout_driver="fused"))
    validate(fused)
    countdown = dataclasses.replace(fused.es_manager.train, env_configs=dataclasses.replace(
        fused.es_manager.train.env_configs, tags=("Countdown",)))
    with pytest.raises(ValueError, match="agent_proxy.rollout_driver=fused.*Countdown"):
        validate(dataclasses.replace(fused, es_manager=dataclasses.replace(fused.es_manager, train=countdown)))
    with pytest.raises(ValueError, match="agent_proxy.rollout_driver=fused requires train_on_sampled_ids"):
        validate(dataclasses.replace(fused, train_on_sampled_ids=False))


def test_tokenizer_merging_across_pieces_is_refused():
    """A BPE without pre-tokenization that learnt ``"\\n\\n"`` joins ``Reward:\\n0\\n`` and ``\\nTurn 2:``."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(["Reward:\n0\n\nTurn 2:\n"] * 50, trainers.BpeTrainer(
        vocab_size=300, special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=["<|im_start|>"], chat_template=CHATML_TEMPLATE)
    tokenizer.add_tokens(list(TAG_TOKENS))
    tokenizer.name_or_path = "no-pretokenizer"
    with pytest.raises(ValueError, match="'no-pretokenizer' merges across .* of Bandit"):
        build_env_tables(envs.make("Bandit"), tokenizer, SETTINGS)


def test_single_turn_tables_still_hold_the_second_turn_piece(setup):
    """RAGEN's Bandit config plays one turn; the tables (and their check) must not index past the end."""
    tables = build_env_tables(envs.make("Bandit"), setup["tokenizer"], dataclasses.replace(SETTINGS, max_turn=1))
    assert tables.turn.ids.shape[0] == 3 and int(tables.turn.lengths[2]) > 0
