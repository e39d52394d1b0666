"""A small byte-level BPE chat tokenizer trained locally, loaded through ``transformers``.

The embedded StarPO demo and the tests need a real tokenizer without a
download: this trains one with ``tokenizers`` on the texts it will see, gives it
Qwen2.5's ChatML special tokens and chat template, saves it as a Hugging Face
folder and loads it back with ``AutoTokenizer``, the path every real checkpoint
takes. Its normaliser and pre-tokeniser follow Qwen2's (NFC; digits one per token;
byte-level), so the folder tokenizes the same whether it is loaded alone or, inside
a model folder whose ``config.json`` says ``qwen2``, as ``transformers``'
``Qwen2Tokenizer``, which installs Qwen2's own pipeline.
"""

from __future__ import annotations

import itertools
import os
from typing import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
TURN_START = "<|im_start|>"
TURN_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, TURN_START, TURN_END)
TAG_TOKENS = ("<think>", "</think>", "<answer>", "</answer>")
# Qwen2's pre-tokenisation pattern, except that a pre-token holds at most one line break, so no merge spans two
# ("\n\n" stays two tokens): a split of Qwen2's own coarser pattern then yields the same ids, and the fused
# rollout's text pieces, which may meet between two line breaks, concatenate to the whole-text encoding.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]?"
                 r"|[^\S\r\n]*[\r\n]|\s+(?!\S)|\s+")

# Qwen2.5-Instruct's ChatML layout, without its tool-calling branches.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_chat_tokenizer(texts: Iterable[str], folder: str | os.PathLike, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Trains a byte-level BPE on ``texts``, saves it to ``folder`` and loads it with ``AutoTokenizer``.

    Args:
      texts: the corpus (prompts, rendered states, example responses); the ChatML role
        headers are added to it, so ``system``, ``user`` and ``assistant`` become tokens.
      folder: where ``tokenizer.json`` and ``tokenizer_config.json`` are written.
      vocab_size: target size including the 256 byte symbols and the special tokens.

    Returns:
      The tokenizer as ``transformers`` loads it: left padding, ChatML template, ``<|im_end|>`` as EOS.
    """
    minimum = 256 + len(SPECIAL_TOKENS) + len(TAG_TOKENS)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum} (bytes + special tokens), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(TAG_TOKENS), special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    role_headers = [f"{TURN_START}{role}\n" for role in ("system", "user", "assistant")] * 100
    tokenizer.train_from_iterator(itertools.chain(texts, role_headers), trainer=trainer)
    tokenizer.add_tokens(list(TAG_TOKENS))
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=TURN_END, pad_token=PAD_TOKEN,
        additional_special_tokens=[TURN_START, TURN_END], padding_side="left", chat_template=CHATML_TEMPLATE,
        model_max_length=32768, clean_up_tokenization_spaces=False)
    wrapped.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)
