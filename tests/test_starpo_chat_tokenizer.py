"""The locally trained chat tokenizer round-trips text and renders Qwen's ChatML layout."""

import json
import shutil

import pytest
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

from starpo_jax.chat_tokenizer import train_chat_tokenizer
from starpo_jax.tokenizer import load_tokenizer

CORPUS = [
    "You are solving the Sokoban puzzle. Push all boxes to targets.\n######\n#_X_P#\n######",
    "<think>The box is left of me.</think><answer>Left || Up</answer>",
    "Reward:\n-0.1\n\nTurn 2:\nState:\n_P_O\nYou have 9 actions left.",
    "You have 10 actions left. Max response length: 100 words (tokens). Reward: 10.5",
] * 20


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_chat_tokenizer(CORPUS, tmp_path_factory.mktemp("tok"), vocab_size=400)


def test_round_trip_and_special_tokens(tokenizer, tmp_path):
    text = "Turn 3:\nState:\n#√S_\nRéward ünïcode 🚀 <think>x</think><answer>Up</answer>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) <= 400
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.padding_side == "left"
    assert len(tokenizer.encode("<think>", add_special_tokens=False)) == 1
    assert len(tokenizer.encode("<|im_start|>", add_special_tokens=False)) == 1
    assert tokenizer.decode(tokenizer.encode("<|im_end|>a", add_special_tokens=False), skip_special_tokens=True) == "a"


def test_model_folder_tokenizes_like_the_tokenizer_folder(tokenizer, tmp_path):
    """Inside a folder whose config.json says qwen2, transformers loads ``Qwen2Tokenizer``, which installs
    Qwen2's own pre-tokeniser: the ids must not change (SFT and rollouts use the two loads)."""
    shutil.copytree(tokenizer.name_or_path, tmp_path, dirs_exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    in_model_folder = load_tokenizer(tmp_path)
    assert isinstance(in_model_folder, Qwen2Tokenizer)
    for text in CORPUS[:4] + ["Turn 12:\nYou have 10 actions left, 2025 points, 3.14 \u00e9t\u00e9\n\n \n\n.\n\nX"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert in_model_folder.encode(text, add_special_tokens=False) == ids
        assert in_model_folder.decode(ids) == text
    assert [tokenizer.decode([i]) for i in tokenizer.encode(" 10", add_special_tokens=False)] == [" ", "1", "0"]
    assert [tokenizer.decode([i]) for i in tokenizer.encode("0\n\nTurn", add_special_tokens=False)][:3] == ["0", "\n", "\n"]


def test_chat_template_is_chatml(tokenizer):
    messages = [{"role": "system", "content": "You're a helpful assistant. "},
                {"role": "user", "content": "Turn 1:\nState:\nP_"},
                {"role": "assistant", "content": "<think>go</think><answer>Right</answer>"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == ("<|im_start|>system\nYou're a helpful assistant. <|im_end|>\n"
                    "<|im_start|>user\nTurn 1:\nState:\nP_<|im_end|>\n"
                    "<|im_start|>assistant\n<think>go</think><answer>Right</answer><|im_end|>\n")
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_too_small_vocab_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="vocab_size must be at least"):
        train_chat_tokenizer(CORPUS, tmp_path, vocab_size=100)
