"""Tokenizer helpers: chat templates (ChatML, Llama 3), left padding, stop strings on a real BPE tokenizer."""

import numpy as np
import pytest

from starpo_jax.chat_tokenizer import train_chat_tokenizer
from starpo_jax.tokenizer import chat_prompt, encode_left_padded, load_tokenizer, stop_string_automaton, token_pieces

CORPUS = ["<think> I should push the box left </think> <answer> Left </answer>",
          "State:\n#P_#\nYou have 3 actions left. Always output: <think> [Your thoughts] </think>"] * 10
LLAMA3_TEMPLATE = (
    "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Go"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    train_chat_tokenizer(CORPUS, folder, vocab_size=320)
    return load_tokenizer(folder)


def test_chatml_prompt_with_think_suffix(tokenizer):
    expected = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nGo<|im_end|>\n"
                "<|im_start|>assistant\n<think>")
    text = chat_prompt(tokenizer, MESSAGES, suffix="<think>")
    assert text == expected
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") and tokenizer.decode(ids) == expected


def test_llama3_template(tokenizer):
    chatml, tokenizer.chat_template = tokenizer.chat_template, LLAMA3_TEMPLATE
    try:
        text = chat_prompt(tokenizer, MESSAGES[1:])
    finally:
        tokenizer.chat_template = chatml
    assert text == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nGo<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_left_padding_rounds_to_bucket(tokenizer):
    texts = ["Left", "<answer> Left </answer>"]
    tokens, mask = encode_left_padded(tokenizer, texts, bucket=8)
    lengths = [len(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    assert tokens.shape[1] == -(-max(lengths) // 8) * 8
    for row, (text, n) in enumerate(zip(texts, lengths)):
        assert mask[row].tolist() == [0] * (tokens.shape[1] - n) + [1] * n
        assert (tokens[row, : tokens.shape[1] - n] == tokenizer.pad_token_id).all()
        assert tokenizer.decode(tokens[row, mask[row].astype(bool)]) == text


def test_stop_string_found_at_the_token_that_completes_it(tokenizer):
    text = "<think> push the box left </think> <answer> Left </answer> more text </answer>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    strings = ["</answer>", "box left"]  # one added token; several BPE tokens
    stop = stop_string_automaton(token_pieces(tokenizer), strings, vocab_size=len(tokenizer) + 4)
    table, lengths = np.asarray(stop.transitions), np.asarray(stop.lengths)
    for n, string in enumerate(strings):
        state, hit = 0, None
        for i, token in enumerate(ids):
            state = table[n, state, token]
            if state == lengths[n] and hit is None:
                hit = i
        assert hit is not None, string
        assert string in tokenizer.decode(ids[: hit + 1]) and string not in tokenizer.decode(ids[:hit])
        assert (table[n, : lengths[n], len(tokenizer):] == 0).all(), "model padding ids reset the match"
        assert (table[n, lengths[n]] == lengths[n]).all(), "a found string stays found"


def test_missing_chat_template_and_pad_are_named(tokenizer):
    from transformers import PreTrainedTokenizerFast
    bare = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
    with pytest.raises(ValueError, match="chat template"):
        chat_prompt(bare, MESSAGES)
    with pytest.raises(ValueError, match="pad"):
        encode_left_padded(bare, ["Left"])
