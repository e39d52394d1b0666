"""Host-driven multi-turn rollout (starpo.md §3): compiled decoding per turn, Python parse and env step.

Each turn decodes every active row with the compiled sampler, continuing one KV
cache across turns: turn 1 feeds the whole prompt, later turns only the text
that follows the previous response (its turn end, the Reward message and the
next state, up to the forced ``<think>``). Responses are parsed with RAGEN's
rules and executed by ``starpo_jax.env_manager``. The training sequence of each
trajectory is either RAGEN's re-rendered chat (default, starpo.md §5) or exactly the
fed and sampled token ids (``train_on_sampled_ids``, starpo.md §22.10).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from envs.text import FORMAT_PENALTY, MAX_ACTIONS_PER_TURN, parse_response
from starpo_jax.env_manager import Slot, apply_context_window, run_turn
from starpo_jax.models.kv_cache import KVCache
from starpo_jax.scores import place_turn_scores
from starpo_jax.trajectory import (Trajectory, chat_tokens, left_pad, loss_mask, position_ids, render_chat,
                                   render_text, turn_end_suffix_length, turn_indicators)


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    """Turn and length limits of one rollout (RAGEN ``agent_proxy`` / ``rollout`` keys)."""

    max_turn: int = 5
    max_actions_per_turn: int = MAX_ACTIONS_PER_TURN
    enable_think: bool = True
    format_penalty: float = FORMAT_PENALTY
    max_model_len: int = 3600
    train_on_sampled_ids: bool = False
    enable_response_mask: bool = True
    mask_alignment: str = "reference"
    bucket: int = 32
    max_context_window: int = -1
    use_turn_scores: bool = False


def turn_continuation(tokenizer: Any, slot: Slot, settings: RolloutSettings) -> str:
    """The prompt text after the last response's turn-end token: Reward, next Turn, generation prompt."""
    messages = render_chat(slot.prefix, slot.history, max_tokens=slot.env.max_tokens,
                           enable_think=settings.enable_think)
    full = render_text(tokenizer, messages, for_update=False, enable_think=settings.enable_think)
    through = tokenizer.apply_chat_template(messages[:-1], tokenize=False)
    return full[through.rindex(tokenizer.eos_token) + len(tokenizer.eos_token):]


def training_tail(tokenizer: Any, slot: Slot, settings: RolloutSettings) -> str:
    """What the training text has after the final response's turn-end token (Qwen: ``"\\n"``)."""
    text = render_text(tokenizer, render_chat(slot.prefix, slot.history, max_tokens=slot.env.max_tokens,
                                              enable_think=settings.enable_think, for_update=True), for_update=True)
    return text[text.rindex(tokenizer.eos_token) + len(tokenizer.eos_token):]


def bucketed(rows: Sequence[Sequence[int]], pad_id: int, bucket: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-pads ``rows`` to the next multiple of ``bucket`` (fewer distinct compiled shapes)."""
    width = -(-max(1, max(len(r) for r in rows)) // bucket) * bucket
    return left_pad(rows, pad_id, width)


def host_rollout(sample: Callable, params: Any, tokenizer: Any, slots: list[Slot], cache: KVCache, key: jax.Array,
                 settings: RolloutSettings = RolloutSettings()) -> Trajectory:
    """Plays every slot to the end (or ``max_turn``) and returns one left-padded sequence per slot.

    Args:
      sample: ``starpo_jax.sampler.make_sampler(...)`` with ``stop_ids`` containing the EOS id.
      params: the policy's parameters (``nnx.split`` state).
      tokenizer: the policy's tokenizer (chat template, EOS = turn-end token, pad token).
      slots: fresh slots (``env_manager.reset_slot``); they are played in place.
      cache: an empty ``KVCache`` with ``len(slots)`` rows and ``max_model_len`` slots.
      key: PRNG key; turn t uses ``fold_in(key, t)``.
    """
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    forced = "<think>" if settings.enable_think else "<answer>"
    window = settings.max_context_window
    fed: list[list[int]] = [[] for _ in slots]
    ended = [True] * len(slots)
    for turn in range(settings.max_turn):
        active = np.array([not slot.done for slot in slots])
        if not active.any():
            break
        for slot in slots:
            apply_context_window(slot, window)
        restart = turn == 0 or window > 0  # a cut history changes the prefix: prefill the window afresh
        if restart:
            cache = cache._replace(lengths=jnp.zeros_like(cache.lengths))
            fed = [[] for _ in slots]
        rows = []
        for i, slot in enumerate(slots):
            if not active[i]:
                rows.append([])
            elif restart:
                rows.append(tokenizer.encode(render_text(
                    tokenizer, render_chat(slot.prefix, slot.history, max_tokens=slot.env.max_tokens,
                                           enable_think=settings.enable_think),
                    for_update=False, enable_think=settings.enable_think), add_special_tokens=False))
            else:
                rows.append(([] if ended[i] else [eos])
                            + tokenizer.encode(turn_continuation(tokenizer, slot, settings), add_special_tokens=False))
        if max(len(f) + len(r) for f, r in zip(fed, rows)) > settings.max_model_len:
            raise ValueError(f"a prompt of turn {turn + 1} exceeds max_model_len={settings.max_model_len} tokens")
        tokens, mask = bucketed(rows, pad, settings.bucket)
        out = sample(params, tokens, mask, cache, jax.random.fold_in(key, turn), active)
        cache = out.cache
        generated, lengths = jax.device_get((out.tokens, out.lengths))
        for i in np.flatnonzero(active):
            ids = [int(t) for t in generated[i, :lengths[i]]]
            fed[i] += rows[i] + ids
            ended[i] = bool(ids) and ids[-1] == eos
            parsed = parse_response(forced + tokenizer.decode(ids, skip_special_tokens=True),
                                    settings.enable_think, settings.max_actions_per_turn)
            run_turn(slots[i], parsed.llm_response, parsed.actions, settings.format_penalty)
    for slot in slots:
        apply_context_window(slot, window)
    if settings.train_on_sampled_ids:
        sequences = [f + ([] if e else [eos]) + tokenizer.encode(training_tail(tokenizer, s, settings),
                                                                 add_special_tokens=False)
                     for f, e, s in zip(fed, ended, slots)]
        return pack_trajectory(tokenizer, slots, settings, sequences)
    return pack_trajectory(tokenizer, slots, settings)


def pack_trajectory(tokenizer: Any, slots: list[Slot], settings: RolloutSettings = RolloutSettings(),
                    sequences: Sequence[Sequence[int]] | None = None) -> Trajectory:
    """Played slots as one left-padded training sequence each, with loss mask, scores and groups.

    ``sequences`` defaults to RAGEN's re-rendered training chat of every slot (starpo.md §5).
    """
    if sequences is None:
        sequences = [tokenizer.encode(render_text(tokenizer, render_chat(
            s.prefix, s.history, max_tokens=s.env.max_tokens, enable_think=settings.enable_think, for_update=True),
            for_update=True), add_special_tokens=False) for s in slots]
    return pack_sequences(tokenizer, sequences, settings, scores=[s.score for s in slots],
                          penalty=[s.penalty for s in slots], group_ids=[s.group_id for s in slots],
                          tag_ids=[s.tag_id for s in slots],
                          turn_scores=[s.turn_scores for s in slots] if settings.use_turn_scores else None)


def pack_sequences(tokenizer: Any, sequences: Sequence[Sequence[int]], settings: RolloutSettings, *,
                   scores: Sequence[float], penalty: Sequence[float], group_ids: Sequence[int],
                   tag_ids: Sequence[int], turn_scores: Sequence[Sequence[float]] | None = None) -> Trajectory:
    """Token sequences as a left-padded, bucketed ``Trajectory`` with its loss mask (both drivers).

    With ``turn_scores`` (each row's per-turn rewards) it also holds ``turn_rewards``, those
    rewards on each assistant turn's end (``scores.place_turn_scores``).
    """
    ids, attention = bucketed(sequences, tokenizer.pad_token_id, settings.bucket)
    if ids.shape[1] > settings.max_model_len:
        raise ValueError(f"a trajectory of {max(map(len, sequences))} tokens exceeds "
                         f"max_model_len={settings.max_model_len}")
    chat = chat_tokens(tokenizer)
    mask = loss_mask(ids, attention, chat, enable_response_mask=settings.enable_response_mask,
                     alignment=settings.mask_alignment)
    turn_rewards = None
    if turn_scores is not None:
        padded = np.zeros((len(turn_scores), max(1, max(map(len, turn_scores)))), np.float32)
        for row, scores_of_row in zip(padded, turn_scores):
            row[:len(scores_of_row)] = scores_of_row
        turn_rewards = np.asarray(place_turn_scores(ids, turn_indicators(ids, chat.turn_start_id), padded,
                                                    chat.turn_end_id, turn_end_suffix_length(tokenizer)))
    return Trajectory(
        input_ids=ids, attention_mask=attention, position_ids=position_ids(attention), loss_mask=np.asarray(mask),
        scores=np.asarray(scores, np.float32), penalty=np.asarray(penalty, np.float32),
        group_ids=np.asarray(group_ids, np.int32), tag_ids=np.asarray(tag_ids, np.int32), turn_rewards=turn_rewards)
