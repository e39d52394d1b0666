"""One token sequence per trajectory in RAGEN's chat layout, with its loss mask (starpo.md §4, §7).

A rollout keeps, per environment, a history of turns (state text, actions left,
normalised response, reward text). ``render_chat`` turns it into chat messages
exactly as RAGEN's ``ContextManager.get_lm_inputs``; the chat template of the
tokenizer makes the text. ``loss_mask`` marks the trained positions from the
token ids alone, so it runs on device for both rollout drivers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from envs.text import SYSTEM_PROMPT, turn_text


@dataclasses.dataclass
class Turn:
    """One history entry: the state shown, the budget left, then the agent's response and reward.

    The last entry of a finished rollout holds only the state after the final action. ``invalid_action``:
    the turn before executed no valid action (RAGEN-2's ``manager_invalid_action`` on this entry).
    """

    state: str | None
    actions_left: int
    llm_response: str | None = None
    reward: str | None = None
    invalid_action: bool = False


# ``agent_proxy.prompt_layout``: v1 puts the environment prefix in the first user message (starpo.md §4), v2 in
# the system message, with the invalid-action warning in generation prompts (ragen2.md §6.6).
PROMPT_LAYOUTS = ("v1", "v2")
# RAGEN-2's ``agent_proxy.context_window_mode`` (ragen2.md §6.7): one sequence per trajectory, or one sample per
# turn (``starpo_jax.turn_samples``).
CONTEXT_WINDOW_MODES = ("full", "limited_multi_turn", "single_turn")


def validate_prompt_keys(prompt_layout: str, context_window_mode: str) -> None:
    """Raises naming the key for an unknown layout or mode."""
    if prompt_layout not in PROMPT_LAYOUTS:
        raise ValueError(f"agent_proxy.prompt_layout must be one of {PROMPT_LAYOUTS}, got {prompt_layout!r}")
    if context_window_mode not in CONTEXT_WINDOW_MODES:
        raise ValueError(f"agent_proxy.context_window_mode must be one of {CONTEXT_WINDOW_MODES}, "
                         f"got {context_window_mode!r}")


def render_chat(prefix: str, history: Sequence[Turn], *, max_tokens: int = 100, enable_think: bool = True,
                for_update: bool = False, layout: str = "v1", first_turn: int = 1) -> list[dict[str, str]]:
    """Chat messages of one trajectory (RAGEN ``get_lm_inputs``).

    Args:
      prefix: the environment prefix (``envs.text.env_prefix``).
      history: the turns so far.
      max_tokens: the "Max response length" announced in each state block.
      enable_think: ``<think>…</think><answer>…</answer>`` format (else ``<answer>`` only).
      for_update: training form: drop the final state-only entry and the last Reward message.
      layout: ``v1``: the prefix opens the first user message; ``v2``: it follows the system prompt, the first
        user message starts empty, and generation prompts warn after a turn with no valid action.
      first_turn: the number of ``history[0]`` (a window of later turns keeps their numbers).
    """
    validate_prompt_keys(layout, "full")
    entries = list(history)
    if for_update and entries and entries[-1].llm_response is None:
        entries = entries[:-1]
    v2 = layout == "v2"
    messages = [{"role": "system", "content": SYSTEM_PROMPT + (prefix if v2 else "")},
                {"role": "user", "content": "" if v2 else prefix}]
    for index, turn in enumerate(entries):
        warning = v2 and not for_update and turn.invalid_action
        messages[-1]["content"] += turn_text(index + first_turn, turn.state, turn.actions_left, max_tokens,
                                             enable_think, warning)
        if turn.llm_response is not None:
            messages.append({"role": "assistant", "content": turn.llm_response})
        if turn.reward is not None and not (for_update and index == len(entries) - 1):
            messages.append({"role": "user", "content": turn.reward})
    return messages


def apply_max_length(messages: list[dict[str, str]], length_of: Callable[[list[dict[str, str]]], int],
                     max_length: int) -> list[dict[str, str]]:
    """Drops the oldest turns until ``length_of(messages) <= max_length`` (RAGEN V2 ``_apply_max_length``).

    The system message is kept. While too long and more than 2 other messages remain, it removes
    [user, assistant, user holding "Reward"] when the conversation starts so, else [user, assistant],
    else one message. A chat that still does not fit is returned as it is (the reference warns).
    """
    length = length_of(messages)
    if length <= max_length:
        return messages
    system, conversation = messages[0], messages[1:]
    while length > max_length and len(conversation) > 2:
        roles = [m["role"] for m in conversation[:3]]
        if roles == ["user", "assistant", "user"] and "Reward" in conversation[2]["content"]:
            conversation = conversation[3:]
        elif roles[:2] == ["user", "assistant"]:
            conversation = conversation[2:]
        else:
            conversation = conversation[1:]
        length = length_of([system] + conversation)
    return [system] + conversation


def render_text(tokenizer: Any, messages: Sequence[dict[str, str]], *, for_update: bool,
                enable_think: bool = True) -> str:
    """The chat template applied; a generation prompt ends with the forced ``<think>`` (or ``<answer>``)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no chat template; StarPO needs one")
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=not for_update)
    return text if for_update else text + ("<think>" if enable_think else "<answer>")


def encode_chat(tokenizer: Any, messages: Sequence[dict[str, str]], *, for_update: bool,
                enable_think: bool = True) -> list[int]:
    """``render_text`` tokenised without added special tokens."""
    return tokenizer.encode(render_text(tokenizer, messages, for_update=for_update, enable_think=enable_think),
                            add_special_tokens=False)


class ChatTokens(NamedTuple):
    """Token facts of a chat template that the masks need.

    Attributes:
      turn_start_id: the token that opens every message (``<|im_start|>``; Llama 3 ``<|start_header_id|>``).
      turn_end_id: the token that closes every message (``<|im_end|>``; Llama 3 ``<|eot_id|>``).
      assistant_header: tokens from ``turn_start_id`` through the end of the assistant header
        (Qwen ``<|im_start|>assistant\\n`` = 3).
    """

    turn_start_id: int
    turn_end_id: int
    assistant_header: int


def chat_tokens(tokenizer: Any) -> ChatTokens:
    """Reads the turn markers and the assistant header length off the tokenizer's chat template."""
    probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    plain = tokenizer.apply_chat_template(probe, tokenize=False)
    prompt = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    header = tokenizer.encode(prompt[len(plain):], add_special_tokens=False)
    ends = tokenizer.encode(plain, add_special_tokens=False)
    if not header or not prompt.startswith(plain):
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r}: chat template has no assistant generation prompt")
    turn_start = header[0]
    closing = [t for t in ends if t in set(tokenizer.all_special_ids) and t != turn_start]
    if not closing:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r}: chat template closes messages with no special token")
    return ChatTokens(turn_start, closing[-1], len(header))


def turn_end_suffix_length(tokenizer: Any) -> int:
    """Tokens the chat template puts after a message's turn-end token (Qwen: ``\\n``, 1; Llama 3: 0).

    RAGEN HEAD shifts turn rewards by this much (+1 for Qwen, starpo.md §7).
    """
    probe = [{"role": "user", "content": "u"}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(probe, tokenize=False), add_special_tokens=False)
    end = chat_tokens(tokenizer).turn_end_id
    return len(ids) - 1 - max(i for i, t in enumerate(ids) if t == end)


def turn_indicators(input_ids: jax.Array, turn_start_id: int) -> jax.Array:
    """``cumsum(input_ids == turn_start)``: 1 = system, 2 = first user, 3 = assistant, 4 = user, … (starpo.md §7)."""
    return jnp.cumsum(input_ids == turn_start_id, axis=-1)


LOSS_MASK_ALIGNMENTS = ("reference", "standard")


def loss_mask(input_ids: jax.Array, attention_mask: jax.Array, chat: ChatTokens, *, enable_response_mask: bool = True,
              alignment: str = "reference") -> jax.Array:
    """Trained positions ``[B, L − 1]``; position j scores token j + 1 (starpo.md §7, §22.2, §22.3).

    ``reference``: RAGEN's mask of token j at position j — with ``enable_response_mask`` the
    assistant segments from their turn-start token to the token before the next turn start,
    else every token after the system message. ``standard``: exactly the assistant content
    tokens and their turn-end token (the tokens after the assistant header), each at the
    position that predicts it; without ``enable_response_mask`` every token after the system
    message, each at the position that predicts it.
    """
    if alignment not in LOSS_MASK_ALIGNMENTS:
        raise ValueError(f"mask_alignment must be one of {LOSS_MASK_ALIGNMENTS}, got {alignment!r}")
    indicators = turn_indicators(input_ids, chat.turn_start_id)
    real = attention_mask > 0
    assistant = (indicators % 2 == 1) & (indicators > 1) & real
    after_system = (indicators > 1) & real
    if alignment == "reference":
        mask = assistant if enable_response_mask else after_system
        return mask[:, :-1].astype(jnp.float32)
    starts = (input_ids == chat.turn_start_id) & real
    start_positions = jax.lax.cummax(jnp.where(starts, jnp.arange(input_ids.shape[1]), -1), axis=1)
    offset = jnp.arange(input_ids.shape[1]) - start_positions
    ended_before = jnp.cumsum(input_ids == chat.turn_end_id, axis=1) - (input_ids == chat.turn_end_id)
    ends_in_segment = ended_before - jax.lax.cummax(jnp.where(starts, ended_before, 0), axis=1)
    content = (offset >= chat.assistant_header) & (ends_in_segment == 0)
    mask = (assistant & content) if enable_response_mask else after_system
    return mask[:, 1:].astype(jnp.float32)


def final_turn_mask(input_ids: jax.Array, attention_mask: jax.Array, chat: ChatTokens, *,
                    alignment: str = "reference") -> jax.Array:
    """Trained positions ``[B, L − 1]`` of per-turn samples: the last message (the final assistant turn) only.

    ``reference``: RAGEN-2's ``limited_multi_turn`` / ``single_turn`` mask (``ctx_manager.py:779-850``), positions
    ``a − 1 … L − 2`` for the last turn-start token at ``a``: every token of the message, header and trailing
    newline included, at the position that predicts it. ``standard``: the ``standard`` ``loss_mask`` inside it.
    """
    indicators = turn_indicators(input_ids, chat.turn_start_id)
    last = (indicators == indicators[:, -1:]) & (indicators > 0) & (attention_mask > 0)
    if alignment == "reference":
        return last[:, 1:].astype(jnp.float32)
    return loss_mask(input_ids, attention_mask, chat, alignment=alignment) * last[:, 1:]


class Trajectory(NamedTuple):
    """A batch of trajectories, left padded to one length L.

    ``input_ids``, ``attention_mask``, ``position_ids``: ``[B, L]``; ``loss_mask``: ``[B, L − 1]``;
    ``scores``: ``[B]`` summed rewards; ``penalty``: ``[B]`` accumulated format penalty;
    ``group_ids``: ``[B]`` initial-state group; ``tag_ids``: ``[B]`` environment tag index;
    ``turn_rewards``: ``[B, L − 1]`` per-turn rewards on the turn ends (``use_turn_scores``), else None;
    ``rollout_log_probs``: ``[B, L − 1]`` the sampler's log-prob of token j + 1 where it was sampled in
    this very context, NaN elsewhere (None when the rollout did not record them);
    ``episode_ids``: ``[B]`` the trajectory each row belongs to, for per-turn samples (``context_window_mode``
    ``limited_multi_turn`` / ``single_turn``; rows of one episode are consecutive), else None.
    """

    input_ids: Any
    attention_mask: Any
    position_ids: Any
    loss_mask: Any
    scores: Any
    penalty: Any
    group_ids: Any
    tag_ids: Any
    turn_rewards: Any = None
    rollout_log_probs: Any = None
    episode_ids: Any = None


def position_ids(attention_mask: Any) -> Any:
    """0-based positions of a left-padded batch: ``max(cumsum(mask) − 1, 0)`` (starpo.md §22.14)."""
    return np.maximum(np.cumsum(attention_mask, axis=-1) - 1, 0).astype(np.int32)


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and attention mask ``[B, L]`` with every row right-aligned."""
    width = max(len(r) for r in rows) if length is None else length
    if any(len(r) > width for r in rows):
        raise ValueError(f"a trajectory of {max(len(r) for r in rows)} tokens exceeds max_model_len={width}")
    ids = np.full((len(rows), width), pad_id, np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        if len(row):
            ids[i, width - len(row):] = row
            mask[i, width - len(row):] = 1
    return ids, mask
