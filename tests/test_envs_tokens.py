"""Token renderers equal the tokenizer's encoding; the on-device parser agrees with the host parser."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import envs
from envs.text import env_prefix, parse_actions
from envs.tokens import build_grid_renderer, build_response_parser, parse_tokens, render_tokens, token_byte_table

QWEN_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
MAX_IDS = 128
BATCH = 64
FRAGMENTS = [
    "<think>", "</think>", "<answer>", "</answer>", "<|im_start|>", "<|im_end|>", "<ans", "wer>", "</", "<",
    "||", "|", " ", "  ", "\n", "\t", "\u00a0", "\u3000", "\u2028", "\x1c", "\x85", "Up", "up", "UP", "Down",
    "down", "Left", "RIGHT", "right", "\u212aeep", "Lef", "jump", "Up Down", "\u00e9", "\U0001f600", "I think",
]


def train_tokenizer(name: str, pre_tokenizer) -> PreTrainedTokenizerFast:
    """A small byte-level BPE trained on the environments' own text (no download)."""
    corpus = [env_prefix(envs.make(tag)) for tag in envs.CUSTOM_ENVS] * 10
    corpus += ["######\n#___##\n#_X__#\n#_O#_#\n#P___#\n######\n", "P___\n_O__\n__G_\n____\n"] * 50
    corpus += ["<think>The box is above the target.</think><answer>Up || Up</answer>"] * 50
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"], clean_up_tokenization_spaces=False,
    )
    wrapped.name_or_path = name
    return wrapped


@pytest.fixture(scope="module")
def tokenizers():
    gpt2 = train_tokenizer("tiny-gpt2-style", pre_tokenizers.ByteLevel(add_prefix_space=False))
    qwen = train_tokenizer("tiny-qwen-style", pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]))
    return {"gpt2": gpt2, "qwen": qwen}


@pytest.mark.parametrize("tag", ["SimpleSokoban", "SokobanDifferentGridVocab", "FrozenLake"])
@pytest.mark.parametrize("style", ["gpt2", "qwen"])
def test_rendered_tokens_equal_the_tokenizer_encoding(tokenizers, tag, style):
    tokenizer, env = tokenizers[style], envs.make(tag)
    renderer = build_grid_renderer(env, tokenizer)
    height, width = env.observation_space(env.default_params).shape
    rng = np.random.default_rng(123)
    grids = rng.integers(0, len(env.grid_lookup), size=(64, height, width))
    if env.walled_grid:
        grids[:, [0, -1], :] = 0
        grids[:, :, [0, -1]] = 0
    ids, lengths = jax.jit(jax.vmap(lambda g: render_tokens(renderer, g)))(jnp.asarray(grids, jnp.int8))
    for i, grid in enumerate(grids):
        text = "\n".join("".join(env.grid_lookup[int(c)] for c in row) for row in grid) + "\n"
        expected = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert list(np.asarray(ids[i, : int(lengths[i])])) == expected


def test_impossible_tokenizer_is_rejected_with_format_and_name():
    merging = train_tokenizer("tiny-no-pretokenizer", pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    with pytest.raises(ValueError, match="SimpleSokoban grid.*tiny-no-pretokenizer"):
        build_grid_renderer(envs.make("SimpleSokoban"), merging)


def test_token_byte_table_matches_decode(tokenizers):
    tokenizer = tokenizers["qwen"]
    table, lengths = token_byte_table(tokenizer)
    for text in ["<think>Up</think>", "caf\u00e9 \U0001f600 ||\u3000Left", "<|im_end|>tail", env_prefix(envs.make("FrozenLake"))]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        decoded = b"".join(bytes(table[i, : lengths[i]]) for i in ids)
        assert decoded == tokenizer.decode(ids, skip_special_tokens=True).encode()


@pytest.fixture(scope="module")
def device_parse(tokenizers):
    """Parses a batch of responses on device and on the host; returns both."""
    tokenizer = tokenizers["qwen"]
    names = envs.make("SimpleSokoban").action_names
    parser = build_response_parser(tokenizer, names)
    parse = jax.jit(jax.vmap(lambda ids, n, left: parse_tokens(parser, ids, n, left)))

    def run(texts: list[str], actions_left: list[int]):
        batch = len(texts)
        texts = texts + [""] * (BATCH - batch)
        encoded = [ids[:MAX_IDS] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        ids = np.zeros((BATCH, MAX_IDS), np.int32)
        for i, row in enumerate(encoded):
            ids[i, : len(row)] = row
        left = np.array(list(actions_left) + [10] * (BATCH - batch))
        out = jax.device_get(parse(ids, np.array([len(r) for r in encoded]), left))
        hosts = [
            parse_actions("<think>" + tokenizer.decode(row, skip_special_tokens=True), names, int(n))
            for row, n in zip(encoded[:batch], left)
        ]
        return [jax.tree.map(lambda x: x[i], out) for i in range(batch)], hosts

    return run


def assert_agree(out, host):
    device_ids = [int(i) for i in np.asarray(out.action_ids) if i >= 0]
    assert device_ids == host.action_ids
    assert bool(out.format_penalty) == host.format_penalty
    assert int(out.num_parsed) == host.num_parsed


@pytest.mark.parametrize("text, expected", [
    ("I push.</think><answer>Up || Left</answer>", [0, 2]),
    ("x</think>  \n<answer>up||DOWN|| right ||</answer>", [0, 1, 3]),
    ("x</think>y<answer>Up</answer></think><answer>Down</answer>", [1]),  # first </think> not followed by <answer>
    ("x</think><answer>Up||Up||Up||Up||Up||Up||Down</answer>", [0, 0, 0, 0, 0]),
    ("x</think><answer>Up|||Down</answer>", [0]),  # "|||" splits into "" and "|Down"
    ("x</think><answer><think>Up</think></answer>", [0]),
    ("x</think><answer>Le<answer>ft</answer>", [2]),
    ("x</think><answer>\u212aeep || \u3000Left\u2028</answer>", [2]),
    ("no closing tags <answer>Up", []),
    ("x</think><answer></answer>", []),
])
def test_hand_written_cases(device_parse, text, expected):
    (out,), (host,) = device_parse([text], [10])
    assert host.action_ids == expected
    assert_agree(out, host)


def test_budget_truncation(device_parse):
    (out,), (host,) = device_parse(["x</think><answer>Up || Down || Left</answer>"], [2])
    assert host.action_ids == [0, 1] and not host.format_penalty
    assert_agree(out, host)


adversarial = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=6)), max_size=14).map("".join)
well_formed = st.builds(
    lambda think, gap, separator, actions: f"{think}</think>{gap}<answer>{separator.join(actions)}</answer>",
    st.text(max_size=10),
    st.sampled_from(["", " ", "\n", "\u3000", "x"]),
    st.sampled_from(["||", " || ", "|| ", "\n||\n"]),
    st.lists(st.sampled_from(["Up", "down", "LEFT", "Right", "Jump", "", " up ", "Dow n"]), max_size=8),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.one_of(adversarial, well_formed), min_size=BATCH, max_size=BATCH),
       actions_left=st.lists(st.integers(0, 10), min_size=BATCH, max_size=BATCH))
def test_device_parser_agrees_with_host(device_parse, texts, actions_left):
    outs, hosts = device_parse(texts, actions_left)
    for out, host in zip(outs, hosts):
        assert_agree(out, host)
