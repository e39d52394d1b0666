"""RAGEN-2's ``SimpleMemory``: the previous turns as plain text in ``single_turn``'s one user message (ragen2.md §6.7).

A ``single_turn`` sample is ``[system, user, assistant]``; the user message summarises the turns of the
window before the current one (state, action, reward) and then shows the current state with the format
instructions. The strings are those of ``ragen/llm_agent/memory/simple_memory.py`` verbatim.
"""

from __future__ import annotations

from typing import Sequence

from envs.text import ANSWER_FORMAT, INVALID_ACTION_WARNING, THINK_FORMAT
from starpo_jax.trajectory import Turn

REWARD_PREFIX = "Reward:\n"


def reward_value(turn: Turn) -> str:
    """The turn's reward as RAGEN's history holds it (``str`` of the summed step rewards, ``envs.text.reward_text``)."""
    return turn.reward[len(REWARD_PREFIX):-1]


def memory_user_content(history: Sequence[Turn], turn_index: int, history_start: int, *, max_tokens: int,
                        enable_think: bool = True, include_warning: bool = False, turn_offset: int = 0) -> str:
    """``SimpleMemory.build_user_content``: turns ``history_start … turn_index − 1`` as text, then ``turn_index``.

    Args:
      history: the episode's turns.
      turn_index: the current turn (0-based); its state is shown last.
      history_start: the first earlier turn shown (``turn_index`` shows none).
      max_tokens: the "Max response length" announced.
      enable_think: ``<think>…</think><answer>…</answer>`` format (else ``<answer>`` only).
      include_warning: the invalid-action warning after the current state when that entry carries the flag
        (generation prompts under the v2 layout).
      turn_offset: added to every shown turn number.
    """
    content = ""
    if history_start < turn_index:
        content += (f"Summary: {turn_index + turn_offset} step(s) completed so far. "
                    f"Showing the last {turn_index - history_start} turn(s) with state/action/reward details. ")
        content += "Recent turns:\n---\n"
        for index in range(history_start, turn_index):
            number, turn = index + 1 + turn_offset, history[index]
            content += f"Turn {number} State:\n{turn.state or ''}\n"
            content += f"Turn {number} Action: {turn.llm_response or ''}\n"
            if turn.reward is not None:
                content += f"Turn {number} Reward: {reward_value(turn)}\n"
            content += "---\n"
    current = history[turn_index]
    warning = INVALID_ACTION_WARNING if include_warning and current.invalid_action else ""
    separator = "\n" if content else ""
    prefix = "Current Turn " if history_start < turn_index else ""
    content += f"{separator}{prefix}(Turn {turn_index + 1 + turn_offset}):\n"
    content += (f"State:\n{current.state}\n{warning}"
                f"You have {current.actions_left} actions left. Always output: "
                f"{THINK_FORMAT if enable_think else ANSWER_FORMAT} "
                f"with no extra text. Strictly follow this format. Max response length: {max_tokens} words (tokens).\n")
    return content
