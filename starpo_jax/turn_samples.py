"""RAGEN-2's per-turn training samples: ``context_window_mode`` ``limited_multi_turn`` and ``single_turn`` (§6.7).

Under ``full`` a trajectory is one training sequence. Under the turn-level modes every played turn is its own
sample, and the policy also generates from the same windowed prompt:

- ``limited_multi_turn``: the chat of the last k = ``agent_proxy.max_context_window`` turns up to this one
  (−1: all), turns keeping their numbers, oldest turns dropped to fit ``max_model_len``;
- ``single_turn``: ``[system, user, assistant]``, the user message summarising the previous k − 1 turns as plain
  text (``simple_memory``), fewer of them shown until it fits ``max_model_len``.

Only the final assistant message trains (``trajectory.final_turn_mask``); each sample carries its episode's
score, and ``episode_ids`` let the filters, the score normalisation and GRPO count episodes, not samples
(``episodes``). Generation prompts carry the v2 invalid-action warning; training samples do not.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from envs.text import SYSTEM_PROMPT
from starpo_jax.simple_memory import memory_user_content
from starpo_jax.trajectory import apply_max_length, encode_chat, render_chat

TURN_LEVEL_MODES = ("limited_multi_turn", "single_turn")


def is_turn_level(context_window_mode: str) -> bool:
    """Whether ``agent_proxy.context_window_mode`` trains one sample per turn."""
    return context_window_mode in TURN_LEVEL_MODES


def window_start(turn_index: int, window: int) -> int:
    """The first turn of the window of ``window`` turns ending at ``turn_index`` (−1: all turns)."""
    return max(0, turn_index - window + 1) if window > 0 else 0


def turn_chat(slot: Any, turn_index: int, start: int, settings: Any, *, for_update: bool) -> list[dict[str, str]]:
    """The messages of turn ``turn_index`` of ``slot`` showing turns from ``start`` on (``settings``' mode).

    ``for_update``: the training sample, ending with the turn's response; else the generation prompt.
    Under the v1 layout the environment prefix opens the user message, under v2 the system message.
    """
    history, v2 = slot.history, settings.prompt_layout == "v2"
    max_tokens, think = slot.env.max_tokens, settings.enable_think
    if settings.context_window_mode == "limited_multi_turn":
        return render_chat(slot.prefix, history[start:turn_index + 1], max_tokens=max_tokens, enable_think=think,
                           for_update=for_update, layout=settings.prompt_layout, first_turn=start + 1)
    user = memory_user_content(history, turn_index, start, max_tokens=max_tokens, enable_think=think,
                               include_warning=v2 and not for_update)
    messages = [{"role": "system", "content": SYSTEM_PROMPT + (slot.prefix if v2 else "")},
                {"role": "user", "content": ("" if v2 else slot.prefix) + user}]
    if for_update:
        messages.append({"role": "assistant", "content": history[turn_index].llm_response})
    return messages


def turn_ids(tokenizer: Any, slot: Any, turn_index: int, settings: Any, *, for_update: bool) -> list[int]:
    """Turn ``turn_index``'s sample (``for_update``) or generation prompt as token ids, fitted to ``max_model_len``.

    ``limited_multi_turn`` drops the oldest messages (RAGEN ``_apply_max_length``); ``single_turn`` shows fewer
    earlier turns (``_fit_single_turn_history_start_to_max_len``). A chat that cannot fit is returned as it is.
    """
    encode = lambda messages: encode_chat(tokenizer, messages, for_update=for_update,
                                          enable_think=settings.enable_think)
    start = window_start(turn_index, settings.max_context_window)
    if settings.context_window_mode == "limited_multi_turn":
        messages = apply_max_length(turn_chat(slot, turn_index, start, settings, for_update=for_update),
                                    lambda m: len(encode(m)), settings.max_model_len)
        return encode(messages)
    while True:
        ids = encode(turn_chat(slot, turn_index, start, settings, for_update=for_update))
        if len(ids) <= settings.max_model_len or start >= turn_index:
            return ids
        start += 1


def prompt_turn_ids(tokenizer: Any, slot: Any, settings: Any) -> list[int]:
    """The generation prompt of ``slot``'s current (last) history entry."""
    return turn_ids(tokenizer, slot, len(slot.history) - 1, settings, for_update=False)


def turn_sequences(tokenizer: Any, slots: Sequence[Any], settings: Any) -> tuple[list[list[int]], list[int]]:
    """Every played turn of every slot as a training sample, and the slot (episode) index of each, in slot order."""
    sequences, episodes = [], []
    for episode, slot in enumerate(slots):
        for index, turn in enumerate(slot.history):
            if turn.llm_response is not None:
                sequences.append(turn_ids(tokenizer, slot, index, settings, for_update=True))
                episodes.append(episode)
    return sequences, episodes


def collapse_detection_applies(context_window_mode: str) -> bool:
    """RAGEN-2 computes the collapse metrics only under ``full`` (``collapse_metrics.py:91-94``); says so once."""
    if not is_turn_level(context_window_mode):
        return True
    logging.warning("collapse_detection is on but agent_proxy.context_window_mode=%s trains per-turn samples: the "
                    "collapse metrics are computed only under context_window_mode=full (as RAGEN-2), so none are "
                    "logged in this run", context_window_mode)
    return False
