"""The fused on-device rollout equals the host driver (greedy, same seeds); its reward-text automaton; both
drivers train on what they sampled; RAGEN's turn prompts (messy responses cleaned, oldest turns dropped)."""

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
from starpo_jax.config import StarPOConfig, resolve
from starpo_jax.config_checks import validate
from starpo_jax.env_manager import GymnaxHostEnv, reset_slot, slot_metrics
from starpo_jax.fused_rollout import build_env_tables, fused_rollout, make_fused_rollout
from starpo_jax.fused_tables import build_reward_table
from starpo_jax.models.config import TransformerConfig
from starpo_jax.models.kv_cache import init_cache
from starpo_jax.models.transformer import CausalLM
from starpo_jax.rollout import RolloutSettings, host_rollout
from starpo_jax.sampler import SamplerConfig, make_sampler
from starpo_jax.steps import make_log_prob_fn
from starpo_jax.trajectory import Turn, render_chat, render_text

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


def tiny_policy(corpus, response, folder, new_tokens):
    """A tokenizer trained on ``corpus`` and ``response``, a tiny random policy and its greedy chain for ``response``.

    Returns ``(tokenizer, config, graphdef, random params, chain params, greedy sampler config)``.
    """
    tokenizer = train_chat_tokenizer(corpus + [f"<think>{response}"] * 20, folder, vocab_size=1024)
    config = TransformerConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2,
                               num_heads=4, num_kv_heads=2, head_dim=8)
    with nnx.use_eager_sharding(False):
        graphdef, params = nnx.split(CausalLM(config, rngs=nnx.Rngs(0)))
    chain = [tokenizer.convert_tokens_to_ids("<think>")] + tokenizer.encode(response) + [tokenizer.eos_token_id]
    assert len(set(chain)) == len(chain), "the chain model needs distinct tokens"
    sampler_config = SamplerConfig(max_new_tokens=new_tokens, greedy=True, stop_ids=(tokenizer.eos_token_id,),
                                   pad_id=tokenizer.pad_token_id)
    return tokenizer, config, graphdef, params, chain_params(params, chain, config), sampler_config


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    corpus = [render_chat(slot.prefix, slot.history)[1]["content"] for slot in make_slots()] * 5
    tokenizer, config, graphdef, params, chain, sampler_config = tiny_policy(corpus, RESPONSE,
                                                                              tmp_path_factory.mktemp("tok"), NEW_TOKENS)
    tables = [build_env_tables(envs.make(t, CUSTOM_ENVS), tokenizer, SETTINGS) for t in TAGS]
    mesh = make_mesh(MeshConfig(2, 4, 1))
    fused = make_fused_rollout(graphdef, config, sampler_config, tables, ROWS, tokenizer, SETTINGS, mesh)
    return dict(tokenizer=tokenizer, config=config, graphdef=graphdef, random=params, chain=chain, tables=tables,
                fused=fused, mesh=mesh, host_sampler=make_sampler(graphdef, sampler_config),
                sampler_config=sampler_config)


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
        if name == "rollout_log_probs":  # two compiled decoders: the same tokens, float32 rounding apart
            np.testing.assert_allclose(a, b, atol=1e-5, err_msg=name)
        else:
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


def test_a_rollout_played_in_concurrent_chunks_samples_what_it_samples_whole(setup):
    """Sampling at T = 1 from the random policy, two blocks of 4 rows: ``chunks=2`` runs two programs of 2 + 2
    rows each (rows 0-1 and 4-5, then 2-3 and 6-7), and every row draws as in the whole batch: the same
    trajectories, sampled log-probs equal to float32 rounding."""
    sampled = SamplerConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, stop_ids=(setup["tokenizer"].eos_token_id,),
                            pad_id=setup["tokenizer"].pad_token_id)
    seeds = (11, 12, 13, 14, 62, 107, 63, 64)
    outs = []
    for chunks in (1, 2):
        program = make_fused_rollout(setup["graphdef"], setup["config"], sampled, setup["tables"][:2], (4, 4),
                                     setup["tokenizer"], SETTINGS, chunks=chunks)
        outs.append(fused_rollout(program, setup["random"], setup["tokenizer"], seeds, range(8), jax.random.key(3)))
    (whole, whole_metrics), (chunked, chunked_metrics) = outs
    for name, a, b in zip(whole._fields, whole, chunked):
        if name == "rollout_log_probs":  # the same tokens; a log-softmax over fewer rows rounds differently
            np.testing.assert_allclose(a, b, atol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)
    assert whole_metrics == chunked_metrics
    assert len({len(row) for row in whole.input_ids.tolist()}) == 1 and whole.loss_mask.sum(axis=1).min() > 0
    with pytest.raises(ValueError, match="rollout_chunks=3 must be >= 1 and divide every block's rows"):
        make_fused_rollout(setup["graphdef"], setup["config"], sampled, setup["tables"][:2], (4, 4),
                           setup["tokenizer"], SETTINGS, chunks=3)


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


@pytest.mark.parametrize("driver", ["host-cleaned", "host-sampled", "fused"])
def test_sampler_log_probs_are_the_updates_old_log_probs(setup, driver):
    """The policy trains on what it sampled from: every trained token that was sampled in that context has, in the update's
    old-log-prob pass, the sampler's log-prob (fp32, 1e-4); with sampled ids every trained token but the
    forced tag and a turn end closing a capped reply was sampled."""
    settings = dataclasses.replace(SETTINGS, mask_alignment="standard", train_on_sampled_ids=driver != "host-cleaned")
    if driver == "fused":
        traj = play_fused(setup, setup["random"], settings).trajectory
    else:
        traj = play_host(setup, setup["random"], settings)[0]
    old = jax.jit(make_log_prob_fn(setup["graphdef"], 1))(setup["random"], nnx.State({}), traj.input_ids,
                                                          traj.attention_mask)
    trained = traj.loss_mask > 0
    sampled = np.isfinite(traj.rollout_log_probs) & trained  # a sampled <|im_start|> ends the trained segment
    assert sampled.sum() >= len(SEEDS) * NEW_TOKENS
    np.testing.assert_allclose(np.asarray(old)[sampled], traj.rollout_log_probs[sampled], atol=1e-4)
    if driver != "host-cleaned":  # rows that sampled a <|im_start|> shift the role parity of the mask after it
        tokenizer, targets = setup["tokenizer"], traj.input_ids[:, 1:]
        intact = ~np.any(np.isfinite(traj.rollout_log_probs) & (targets == tokenizer.convert_tokens_to_ids(
            "<|im_start|>")), axis=1)
        assert intact.sum() >= len(SEEDS) // 2
        unsampled = set(targets[intact][(trained & ~sampled)[intact]].tolist())
        assert unsampled <= {tokenizer.convert_tokens_to_ids("<think>"), tokenizer.eos_token_id}


MESSY = " go\t</think>\n<answer> Left ||Up|| Down</answer>!"  # spaces in tags, text between and after, 3 actions
CLEANED = "<think>go</think><answer>Left || Up</answer>"  # RAGEN's _parse_response with max_actions_per_turn=2
MESSY_NEW_TOKENS = 24


class SpySampler:
    """The real sampler, recording the ids each cache row holds when a turn decodes."""

    def __init__(self, sample, rows):
        self.sample, self.held, self.contexts = sample, [[] for _ in range(rows)], [[] for _ in range(rows)]

    def __call__(self, params, tokens, mask, cache, key, active):
        reused, segment, live = np.asarray(cache.lengths), np.asarray(tokens), np.asarray(active)
        out = self.sample(params, tokens, mask, cache, key, active)
        generated, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
        for i, held in enumerate(self.held):
            context = held[:reused[i]] + segment[i][np.asarray(mask)[i] > 0].tolist()
            if live[i]:
                self.contexts[i].append(context)
            self.held[i] = context + generated[i, :lengths[i]].tolist()
        return out


@pytest.fixture(scope="module")
def messy(setup):
    tokenizer = setup["tokenizer"]
    chain = ([tokenizer.convert_tokens_to_ids("<think>")] + tokenizer.encode(MESSY, add_special_tokens=False)
             + [tokenizer.eos_token_id])
    assert len(set(chain)) == len(chain), "the chain model needs distinct tokens"
    sampler = make_sampler(setup["graphdef"], dataclasses.replace(setup["sampler_config"],
                                                                  max_new_tokens=MESSY_NEW_TOKENS))
    return chain_params(setup["random"], chain, setup["config"]), sampler


def play_messy(setup, messy, max_model_len, **settings):
    params, sampler = messy
    spy = SpySampler(sampler, len(SEEDS))
    settings = RolloutSettings(max_turn=3, max_actions_per_turn=2, max_model_len=max_model_len, bucket=64, **settings)
    slots = make_slots()
    traj = host_rollout(spy, params, setup["tokenizer"], slots,
                        init_cache(setup["config"], len(slots), max_model_len + MESSY_NEW_TOKENS), jax.random.key(7),
                        settings)
    return traj, slots, spy.contexts


@pytest.fixture(scope="module")
def messy_played(setup, messy):
    return play_messy(setup, messy, 768)


def ragen_messages(slot, turns, for_update):
    """RAGEN's chat after ``turns`` answered turns, each response cleaned by hand to CLEANED."""
    history = [Turn(h.state, h.actions_left, CLEANED, h.reward) for h in slot.history[:turns]]
    history.append(Turn(slot.history[turns].state, slot.history[turns].actions_left))
    return render_chat(slot.prefix, history, max_tokens=slot.env.max_tokens, for_update=for_update)


def test_turn_prompts_are_ragens_rerendered_chat_of_messy_responses(setup, messy_played):
    tokenizer = setup["tokenizer"]
    traj, slots, contexts = messy_played
    assert max(len(s.history) for s in slots) == 4 and min(len(s.history) for s in slots) == 2
    for row, slot in enumerate(slots):
        turns = len(slot.history) - 1
        assert [h.llm_response for h in slot.history[:turns]] == [CLEANED] * turns
        assert [tokenizer.decode(c) for c in contexts[row]] == [
            render_text(tokenizer, ragen_messages(slot, k, False), for_update=False) for k in range(turns)]
        text = tokenizer.decode(traj.input_ids[row][traj.attention_mask[row] > 0])
        assert text == render_text(tokenizer, ragen_messages(slot, turns, True), for_update=True)


def test_long_chats_drop_the_oldest_turns_in_prompts_and_training(setup, messy, messy_played):
    tokenizer = setup["tokenizer"]
    _, full_slots, full_contexts = messy_played
    row = next(i for i, s in enumerate(full_slots) if len(s.history) == 4)
    limit = len(full_contexts[row][2]) - 1  # the third prompt no longer fits
    traj, slots, contexts = play_messy(setup, messy, limit, use_turn_scores=True)
    assert contexts[row][:2] == full_contexts[row][:2]
    third = ragen_messages(slots[row], 2, False)
    assert third[3]["content"].startswith("Reward") and third[4]["role"] == "assistant"
    assert tokenizer.decode(contexts[row][2]) == render_text(tokenizer, third[:1] + third[4:], for_update=False)
    trained = ragen_messages(slots[row], 3, True)
    text = tokenizer.decode(traj.input_ids[row][traj.attention_mask[row] > 0])
    assert text == render_text(tokenizer, trained[:1] + trained[4:], for_update=True)
    assert traj.input_ids.shape[1] <= limit and max(len(c) for row_contexts in contexts for c in row_contexts) <= limit
    np.testing.assert_allclose(traj.turn_rewards[row].sum(), sum(slots[row].turn_scores[1:]))
    with pytest.raises(ValueError, match="over max_model_len=.*cannot drop its oldest turns"):
        play_messy(setup, messy, limit, train_on_sampled_ids=True)
