"""Tokenizer helpers through ``transformers.AutoTokenizer``: chat prompts, left padding, stop strings."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from starpo_jax.models.hf_io import resolve_folder
from starpo_jax.sampler import StopStrings


def load_tokenizer(name_or_path: str | Path) -> Any:
    """``AutoTokenizer`` from a folder or a hub-cache id, padding on the left."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(resolve_folder(name_or_path), padding_side="left")


def require_chat_template(tokenizer: Any) -> Any:
    """Returns ``tokenizer``; raises naming it when it has no chat template (a base model's tokenizer)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no chat template (chat_template in "
                         f"tokenizer_config.json or chat_template.jinja): use an instruct/chat model's tokenizer")
    return tokenizer


def chat_prompt(tokenizer: Any, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True,
                suffix: str = "") -> str:
    """The chat template applied to ``messages`` (Qwen ChatML, Llama 3, ...), then ``suffix`` (e.g. ``<think>``)."""
    text = require_chat_template(tokenizer).apply_chat_template(list(messages), tokenize=False,
                                                                add_generation_prompt=add_generation_prompt)
    return text + suffix


def encode_left_padded(tokenizer: Any, texts: Sequence[str], bucket: int = 1,
                       pad_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and mask ``[B, W]``, left padded to W = the longest row rounded up to ``bucket``.

    Rounding to a bucket keeps the number of compiled shapes small.
    """
    pad_id = tokenizer.pad_token_id if pad_id is None else pad_id
    if pad_id is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no pad token; pass pad_id")
    rows = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    width = max(1, max(len(r) for r in rows))
    width = -(-width // bucket) * bucket
    tokens = np.full((len(rows), width), pad_id, np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        if row:
            tokens[i, width - len(row):] = row
            mask[i, width - len(row):] = 1
    return tokens, mask


def token_pieces(tokenizer: Any) -> list[str]:
    """The text of every token id decoded on its own (special tokens included)."""
    return tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=False,
                                  clean_up_tokenization_spaces=False)


def _kmp_step(pattern: str, failure: list[int], state: int, char: str) -> int:
    while state and pattern[state] != char:
        state = failure[state - 1]
    return state + 1 if pattern[state] == char else 0


def _failure(pattern: str) -> list[int]:
    """Knuth-Morris-Pratt failure function: longest proper prefix that is also a suffix of pattern[:i+1]."""
    failure = [0] * len(pattern)
    for i in range(1, len(pattern)):
        failure[i] = _kmp_step(pattern, failure, failure[i - 1], pattern[i])
    return failure


def _string_table(pattern: str, pieces: Sequence[str], vocab_size: int, states: int) -> np.ndarray:
    """``table[state, token]`` for one stop string; state ``len(pattern)`` (matched) is absorbing."""
    m, failure, chars = len(pattern), _failure(pattern), set(pattern)
    table = np.zeros((states, vocab_size), np.int32)
    table[m:] = m

    def run(state: int, text: str) -> int:
        for char in text:
            state = _kmp_step(pattern, failure, state, char)
            if state == m:
                return m
        return state

    for token, piece in enumerate(pieces):
        if not chars.intersection(piece):
            continue
        cut = next((i for i, c in enumerate(piece) if c not in chars), len(piece))
        tail = run(0, piece[cut:])
        for state in range(m):
            after_prefix = run(state, piece[:cut])
            table[state, token] = m if after_prefix == m else (after_prefix if cut == len(piece) else tail)
    return table


def stop_string_automaton(pieces: Sequence[str], stop_strings: Sequence[str], vocab_size: int) -> StopStrings:
    """Per-token transitions of a KMP matcher for each stop string, for on-device stop detection.

    A string is found even when it spans several tokens or sits inside one. Token ids
    from ``len(pieces)`` to ``vocab_size`` (model padding) reset the match.
    """
    if not stop_strings or any(not s for s in stop_strings):
        raise ValueError(f"stop_strings must be non-empty strings, got {list(stop_strings)!r}")
    if len(pieces) > vocab_size:
        raise ValueError(f"tokenizer has {len(pieces)} tokens, more than the model's vocab_size {vocab_size}")
    states = max(len(s) for s in stop_strings) + 1
    tables = np.stack([_string_table(s, pieces, vocab_size, states) for s in stop_strings])
    return StopStrings(jnp.asarray(tables), jnp.asarray([len(s) for s in stop_strings], jnp.int32))

