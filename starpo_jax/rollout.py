"""Host-driven multi-turn rollout (starpo.md §3): compiled decoding per turn, Python parse and env step.

By default every turn's prompt is RAGEN's re-rendered chat of the cleaned history
(``ContextManager.get_lm_inputs``: normalised responses, oldest turns dropped to fit
``max_model_len``), and the training sequence is the re-rendered training chat, so the
policy generates from and trains on the same text. The KV cache is reused for the longest
common token prefix of the cached sequence and the new prompt (prefix caching): only the
rest is prefilled. With ``train_on_sampled_ids`` (starpo.md §22.10) the cache instead continues
the raw sampled ids and the training sequence is exactly the fed and sampled ids.
Responses are parsed with RAGEN's rules and executed by ``starpo_jax.env_manager``. Under RAGEN-2's turn-level
``context_window_mode`` the prompts are the turn windows and every played turn becomes a training sample
(``starpo_jax.turn_samples``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np

from envs.text import FORMAT_PENALTY, MAX_ACTIONS_PER_TURN, parse_response
from starpo_jax.env_manager import Slot, apply_context_window
from starpo_jax.env_pool import run_turns
from starpo_jax.models.kv_cache import KVCache
from starpo_jax.scores import place_turn_scores
from starpo_jax.trajectory import (Trajectory, apply_max_length, chat_tokens, encode_chat, final_turn_mask, left_pad,
                                   loss_mask, position_ids, render_chat, render_text, turn_end_suffix_length,
                                   turn_indicators)
from starpo_jax.turn_samples import is_turn_level, prompt_turn_ids, turn_sequences


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
    prompt_layout: str = "v1"
    context_window_mode: str = "full"


def slot_chat(slot: Slot, settings: RolloutSettings, *, for_update: bool = False) -> list[dict[str, str]]:
    """RAGEN's chat of ``slot``: its tag's ``max_tokens``, the settings' think format and prompt layout."""
    return render_chat(slot.prefix, slot.history, max_tokens=slot.env.max_tokens, enable_think=settings.enable_think,
                       for_update=for_update, layout=settings.prompt_layout)


def turn_continuation(tokenizer: Any, slot: Slot, settings: RolloutSettings) -> str:
    """The prompt text after the last response's turn-end token: Reward, next Turn, generation prompt."""
    messages = slot_chat(slot, settings)
    full = render_text(tokenizer, messages, for_update=False, enable_think=settings.enable_think)
    through = tokenizer.apply_chat_template(messages[:-1], tokenize=False)
    return full[through.rindex(tokenizer.eos_token) + len(tokenizer.eos_token):]


def training_tail(tokenizer: Any, slot: Slot, settings: RolloutSettings) -> str:
    """What the training text has after the final response's turn-end token (Qwen: ``"\\n"``)."""
    text = render_text(tokenizer, slot_chat(slot, settings, for_update=True), for_update=True)
    return text[text.rindex(tokenizer.eos_token) + len(tokenizer.eos_token):]


def chat_ids(tokenizer: Any, slot: Slot, settings: RolloutSettings, *, for_update: bool) -> tuple[list[int], int]:
    """RAGEN's chat of ``slot`` as token ids, oldest turns dropped to fit ``max_model_len`` (spec ragen2 §6.6).

    ``for_update=False``: the generation prompt of the next turn (its length counted with the forced
    tag, so prompt and response always fit the cache); ``True``: the training sequence. Returns the
    ids and the number of assistant messages kept.
    """
    encode = lambda messages: encode_chat(tokenizer, messages, for_update=for_update,
                                          enable_think=settings.enable_think)
    messages = slot_chat(slot, settings, for_update=for_update)
    ids = encode(messages)
    if len(ids) > settings.max_model_len:  # most chats fit: encoded once
        messages = apply_max_length(messages, lambda m: len(encode(m)), settings.max_model_len)
        ids = encode(messages)
    return ids, sum(m["role"] == "assistant" for m in messages)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


def bucketed(rows: Sequence[Sequence[int]], pad_id: int, bucket: int,
             limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Left-pads ``rows`` to the next multiple of ``bucket`` (fewer distinct compiled shapes), at most ``limit``."""
    longest = max(1, max(len(r) for r in rows))
    width = -(-longest // bucket) * bucket
    return left_pad(rows, pad_id, width if limit is None else max(longest, min(width, limit)))


class _Record(NamedTuple):
    """One decode of one row: the ids the cache held, the sampled ids and their log-probs."""

    context: list[int]
    sampled: list[int]
    log_probs: np.ndarray


def host_rollout(sample: Callable, params: Any, tokenizer: Any, slots: list[Slot], cache: KVCache, key: jax.Array,
                 settings: RolloutSettings = RolloutSettings()) -> Trajectory:
    """Plays every slot to the end (or ``max_turn``) and returns one left-padded sequence per slot.

    Args:
      sample: ``starpo_jax.sampler.make_sampler(...)`` with ``stop_ids`` containing the EOS id.
      params: the policy's parameters (``nnx.split`` state).
      tokenizer: the policy's tokenizer (chat template, EOS = turn-end token, pad token).
      slots: fresh slots (``env_manager.reset_slot``); they are played in place.
      cache: an empty ``KVCache`` with ``len(slots)`` rows and ``max_model_len + max_new_tokens`` slots.
      key: PRNG key; turn t uses ``fold_in(key, t)``.

    Raises:
      ValueError: when a prompt outgrows ``max_model_len``: with ``train_on_sampled_ids`` (one id
        sequence cannot drop turns), else only when a single turn is longer than the limit.
    """
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    forced = "<think>" if settings.enable_think else "<answer>"
    raw = settings.train_on_sampled_ids
    if raw and (settings.max_context_window > 0 or is_turn_level(settings.context_window_mode)):
        raise ValueError("max_context_window and the turn-level context_window_mode re-render the history each turn: "
                         "set train_on_sampled_ids=False")
    cut = -1 if is_turn_level(settings.context_window_mode) else settings.max_context_window  # full: V1 HEAD's cut
    cached: list[list[int]] = [[] for _ in slots]  # the ids each cache row holds
    records: list[list[_Record]] = [[] for _ in slots]
    ended = [True] * len(slots)
    for turn in range(settings.max_turn):
        active = np.array([not slot.done for slot in slots])
        if not active.any():
            break
        prompts, reuse = [], []
        for i, slot in enumerate(slots):
            apply_context_window(slot, cut)
            if not active[i]:
                prompts.append(cached[i])
            elif raw:
                prompts.append(cached[i] + ([] if ended[i] or turn == 0 else [eos]) + tokenizer.encode(
                    turn_continuation(tokenizer, slot, settings) if turn else render_text(
                        tokenizer, slot_chat(slot, settings), for_update=False, enable_think=settings.enable_think),
                    add_special_tokens=False))
            elif is_turn_level(settings.context_window_mode):
                prompts.append(prompt_turn_ids(tokenizer, slot, settings))
            else:
                prompts.append(chat_ids(tokenizer, slot, settings, for_update=False)[0])
            reuse.append(min(common_prefix(cached[i], prompts[i]), len(prompts[i]) - active[i]))
        longest = max(len(p) for p in prompts)
        if longest > settings.max_model_len:
            raise ValueError(
                f"a prompt of turn {turn + 1} has {longest} tokens, over max_model_len={settings.max_model_len}: "
                + ("train_on_sampled_ids keeps one sampled id sequence, which cannot drop its oldest turns; raise "
                   "max_model_len or set train_on_sampled_ids=False" if raw else
                   "a single turn is longer than the limit even with every older turn dropped"))
        tokens, mask = bucketed([p[k:] for p, k in zip(prompts, reuse)], pad, settings.bucket)
        cache = cache._replace(lengths=jax.device_put(np.asarray(reuse, np.int32), cache.lengths.sharding))
        out = sample(params, tokens, mask, cache, jax.random.fold_in(key, turn), active)
        cache = out.cache
        generated, log_probs, lengths = jax.device_get((out.tokens, out.log_probs, out.lengths))
        turns = []
        for i in np.flatnonzero(active):
            ids = [int(t) for t in generated[i, :lengths[i]]]
            records[i].append(_Record(prompts[i], ids, log_probs[i, :lengths[i]]))
            cached[i] = prompts[i] + ids
            ended[i] = bool(ids) and ids[-1] == eos
            parsed = parse_response(forced + tokenizer.decode(ids, skip_special_tokens=True),
                                    settings.enable_think, settings.max_actions_per_turn)
            turns.append((slots[i], parsed.llm_response, parsed.actions))
        run_turns(turns, settings.format_penalty)
    for slot in slots:
        apply_context_window(slot, cut)
    sequences = None
    if raw:
        sequences = [c + ([] if e else [eos]) + tokenizer.encode(training_tail(tokenizer, s, settings),
                                                                 add_special_tokens=False)
                     for c, e, s in zip(cached, ended, slots)]
    return pack_trajectory(tokenizer, slots, settings, sequences, records)


def sampled_log_probs(sequence: Sequence[int], records: Sequence[_Record]) -> np.ndarray:
    """Per token of ``sequence``: its sampler log-prob where it was sampled in this very context, else NaN.

    A record counts when its context is a prefix of ``sequence``; its sampled ids count as far as
    ``sequence`` repeats them (the cleaned response can differ from what was sampled).
    """
    out = np.full(len(sequence), np.nan, np.float32)
    for context, sampled, log_probs in records:
        n = len(context)
        if common_prefix(sequence, context) == n:
            k = common_prefix(sequence[n:], sampled)
            out[n:n + k] = log_probs[:k]
    return out


def pack_trajectory(tokenizer: Any, slots: list[Slot], settings: RolloutSettings = RolloutSettings(),
                    sequences: Sequence[Sequence[int]] | None = None,
                    records: Sequence[Sequence[_Record]] | None = None) -> Trajectory:
    """Played slots as one left-padded training sequence each, with loss mask, scores and groups.

    ``sequences`` defaults to RAGEN's re-rendered training chat of every slot (starpo.md §5), oldest turns
    dropped to fit ``max_model_len``; with ``use_turn_scores`` only the kept turns' scores are placed.
    ``records`` (per slot, from ``host_rollout``) give the trajectory's ``rollout_log_probs``. Under a turn-level
    ``context_window_mode`` every played turn is a row (``turn_samples.turn_sequences``) with its episode's score.
    """
    if is_turn_level(settings.context_window_mode):
        sequences, episodes = turn_sequences(tokenizer, slots, settings)
        rollout_log_probs = None if records is None else [sampled_log_probs(q, records[e])
                                                          for q, e in zip(sequences, episodes)]
        return pack_sequences(tokenizer, sequences, settings, **_slot_fields([slots[e] for e in episodes]),
                              rollout_log_probs=rollout_log_probs, episode_ids=episodes)
    turn_scores = [s.turn_scores for s in slots]
    if sequences is None:
        packed = [chat_ids(tokenizer, s, settings, for_update=True) for s in slots]
        sequences = [ids for ids, _ in packed]
        turn_scores = [scores[len(scores) - kept:] if kept else [] for scores, (_, kept) in zip(turn_scores, packed)]
    rollout_log_probs = None if records is None else [sampled_log_probs(q, r) for q, r in zip(sequences, records)]
    return pack_sequences(tokenizer, sequences, settings, **_slot_fields(slots),
                          turn_scores=turn_scores if settings.use_turn_scores else None,
                          rollout_log_probs=rollout_log_probs)


def _slot_fields(slots: Sequence[Slot]) -> dict[str, list]:
    """The per-row ``pack_sequences`` fields of played slots."""
    return dict(scores=[s.score for s in slots], penalty=[s.penalty for s in slots],
                group_ids=[s.group_id for s in slots], tag_ids=[s.tag_id for s in slots])


def pack_sequences(tokenizer: Any, sequences: Sequence[Sequence[int]], settings: RolloutSettings, *,
                   scores: Sequence[float], penalty: Sequence[float], group_ids: Sequence[int],
                   tag_ids: Sequence[int], turn_scores: Sequence[Sequence[float]] | None = None,
                   rollout_log_probs: Sequence[Sequence[float]] | None = None,
                   episode_ids: Sequence[int] | None = None) -> Trajectory:
    """Token sequences as a left-padded, bucketed ``Trajectory`` with its loss mask (both drivers).

    With ``turn_scores`` (each row's per-turn rewards) it also holds ``turn_rewards``, those
    rewards on each assistant turn's end (``scores.place_turn_scores``). ``rollout_log_probs``
    (per token of each sequence, NaN where not sampled) become ``[B, L − 1]`` by next-token position.
    Under a turn-level ``context_window_mode`` only each row's final message trains; ``episode_ids`` are kept.
    """
    longest = max(map(len, sequences))
    if longest > settings.max_model_len:
        raise ValueError(f"a trajectory of {longest} tokens exceeds max_model_len={settings.max_model_len} "
                         f"(a single turn longer than the limit)")
    ids, attention = bucketed(sequences, tokenizer.pad_token_id, settings.bucket, settings.max_model_len)
    chat = chat_tokens(tokenizer)
    if is_turn_level(settings.context_window_mode):
        mask = final_turn_mask(ids, attention, chat, alignment=settings.mask_alignment)
    else:
        mask = loss_mask(ids, attention, chat, enable_response_mask=settings.enable_response_mask,
                         alignment=settings.mask_alignment)
    turn_rewards = None
    if turn_scores is not None:
        padded = np.zeros((len(turn_scores), max(1, max(map(len, turn_scores)))), np.float32)
        for row, scores_of_row in zip(padded, turn_scores):
            row[:len(scores_of_row)] = scores_of_row
        turn_rewards = np.asarray(place_turn_scores(ids, turn_indicators(ids, chat.turn_start_id), padded,
                                                    chat.turn_end_id, turn_end_suffix_length(tokenizer)))
    sampled = None
    if rollout_log_probs is not None:
        sampled = np.full(ids.shape, np.nan, np.float32)
        for row, values in zip(sampled, rollout_log_probs):
            row[len(row) - len(values):] = values
        sampled = sampled[:, 1:]
    return Trajectory(
        input_ids=ids, attention_mask=attention, position_ids=position_ids(attention), loss_mask=np.asarray(mask),
        scores=np.asarray(scores, np.float32), penalty=np.asarray(penalty, np.float32),
        group_ids=np.asarray(group_ids, np.int32), tag_ids=np.asarray(tag_ids, np.int32), turn_rewards=turn_rewards,
        rollout_log_probs=sampled, episode_ids=None if episode_ids is None else np.asarray(episode_ids, np.int32))
