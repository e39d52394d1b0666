"""RAGEN-2's template-collapse detector: (prompt, reasoning) sample sets and their metrics (ragen2.md §3).

Every ``compute_freq`` steps, on the full unfiltered rollout batch and with the sampling weights,
the detector takes two sample sets of (X, Z) pairs — X the chat through a turn's forced ``<think>``,
Z that turn's reasoning — scores every reasoning under every prompt in one compiled program
(``collapse_scoring``) and reports the ``collapse_metrics`` of each set:

- ``collapse_first_turn_sample/*``: first turns, one column per initial-state group;
- ``collapse_trajectory_sample/*``: turns drawn trajectory-uniformly (with replacement), one column each.

X is cut from the trajectory's own token ids (the chat as trained, so no invalid-action warning and no
context window, as in the reference); Z is the reference's text rule — the first ``<think>(.*?)</think>``
of the turn's response, special strings removed, stripped, tokenized on its own. Sampling is keyed by the
run's seed and the step instead of NumPy's global state (ragen2.md §3.9).
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any, NamedTuple, Sequence

import numpy as np
from flax import nnx
from jax.sharding import Mesh

from starpo_jax.collapse_config import CollapseDetectionConfig
from starpo_jax.collapse_metrics import MarginalStdEma, pair_metrics
from starpo_jax.collapse_scoring import make_cross_log_probs
from starpo_jax.models.config import TransformerConfig
from starpo_jax.trajectory import ChatTokens, Trajectory, chat_tokens

log = logging.getLogger(__name__)
THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)
STRIPPED = ("<think>", "</think>", "<answer>", "</answer>", "<|im_start|>", "<|im_end|>")
FIRST_TURN, TRAJECTORY = "collapse_first_turn_sample", "collapse_trajectory_sample"
ROW_BUCKET, PROMPT_BUCKET, REASONING_BUCKET = 8, 64, 16


class TurnPair(NamedTuple):
    """One turn's prompt X (ids through the forced ``<think>``) and reasoning Z (ids)."""

    prompt: tuple[int, ...]
    reasoning: tuple[int, ...]


def reasoning_text(response: str) -> str:
    """Z of one response: the first ``<think>…</think>`` content, special strings removed, stripped."""
    match = THINK.search(response)
    if match is None:
        return ""
    text = match.group(1)
    for special in STRIPPED:
        text = text.replace(special, "")
    return text.strip()


def turn_pairs(tokenizer: Any, traj: Trajectory, chat: ChatTokens | None = None) -> tuple[list[list[TurnPair | None]],
                                                                                         list[int]]:
    """Per trajectory, each assistant turn's pair (None when its reasoning is empty), and the turn counts."""
    chat = chat_tokens(tokenizer) if chat is None else chat
    think = tuple(tokenizer.encode("<think>", add_special_tokens=False))
    pairs, totals = [], []
    for ids, mask in zip(np.asarray(traj.input_ids), np.asarray(traj.attention_mask)):
        ids = [int(t) for t in ids[mask > 0]]
        starts = [i for i, t in enumerate(ids) if t == chat.turn_start_id]
        turns = []
        for k, start in enumerate(starts[2::2]):  # system, user, then every second message is the assistant's
            begin = start + chat.assistant_header
            end = starts[2 + 2 * k + 1] if 2 + 2 * k + 1 < len(starts) else len(ids)
            content = ids[begin:end]
            if chat.turn_end_id in content:
                content = content[:content.index(chat.turn_end_id)]
            z = reasoning_text(tokenizer.decode(content))
            turns.append(TurnPair(tuple(ids[:begin]) + think, tuple(tokenizer.encode(z, add_special_tokens=False)))
                         if z else None)
        pairs.append(turns)
        totals.append(len(turns))
    return pairs, totals


class SampleSet(NamedTuple):
    """Rows (reasonings), columns (prompts) and each row's true column."""

    reasonings: list[tuple[int, ...]]
    prompts: list[tuple[int, ...]]
    columns: list[int]


def first_turn_set(pairs: Sequence[Sequence[TurnPair | None]], group_ids: Sequence[int], num_samples: int | None,
                   rng: np.random.Generator) -> SampleSet:
    """Valid first turns (all, or ``num_samples`` without replacement), one column per group, ascending ids.

    Raises:
      ValueError: when two selected first turns of one group show different prompts (the reference's rule).
    """
    valid = [m for m, turns in enumerate(pairs) if turns and turns[0] is not None]
    if num_samples is not None and num_samples < len(valid):
        valid = sorted(rng.choice(valid, num_samples, replace=False).tolist())
    groups = sorted({int(group_ids[m]) for m in valid})
    prompts = {}
    for m in valid:
        prompt = prompts.setdefault(int(group_ids[m]), pairs[m][0].prompt)
        if prompt != pairs[m][0].prompt:
            raise ValueError(f"group {int(group_ids[m])} has first-turn prompts that differ")
    return SampleSet([pairs[m][0].reasoning for m in valid], [prompts[g] for g in groups],
                     [groups.index(int(group_ids[m])) for m in valid])


def trajectory_set(pairs: Sequence[Sequence[TurnPair | None]], num_samples: int | None,
                   rng: np.random.Generator) -> SampleSet:
    """Trajectory-uniform draws with replacement; every drawn pair is its own column (ragen2.md §3.5)."""
    kept = [[pair for pair in turns if pair is not None] for turns in pairs]
    total = sum(len(turns) for turns in kept)
    draws = total if num_samples is None else min(num_samples, total)
    chosen = []
    for _ in range(draws):
        m = int(rng.integers(len(kept)))
        if kept[m]:
            chosen.append(kept[m][int(rng.integers(len(kept[m])))])
    return SampleSet([p.reasoning for p in chosen], [p.prompt for p in chosen], list(range(len(chosen))))


def _padded(rows: Sequence[Sequence[int]], count: int, width: int, left: bool) -> tuple[np.ndarray, np.ndarray]:
    """``count`` rows of ``width`` ids (extra rows repeat the first); left or right aligned."""
    ids, mask = np.zeros((count, width), np.int32), np.zeros((count, width), np.int32)
    for i in range(count):
        row = rows[i] if i < len(rows) else rows[0]
        where = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, where], mask[i, where] = row, 1
    return ids, mask


def _bucket(value: int, step: int) -> int:
    return max(step, -(-value // step) * step)


class CollapseDetector:
    """Runs both families on a rollout batch and keeps their EMA state (not checkpointed, as in RAGEN-2)."""

    def __init__(self, config: CollapseDetectionConfig, graphdef: nnx.GraphDef, model_config: TransformerConfig,
                 tokenizer: Any, temperature: float = 1.0, mesh: Mesh | None = None, seed: int = 0):
        self.config, self.tokenizer, self.seed = config, tokenizer, seed
        self.chat = chat_tokens(tokenizer)
        self.cross = make_cross_log_probs(graphdef, model_config, temperature, mesh)
        self.row_multiple = ROW_BUCKET if mesh is None else int(np.lcm(ROW_BUCKET, mesh.devices.size))
        self.ema = {FIRST_TURN: MarginalStdEma(), TRAJECTORY: MarginalStdEma()}
        self.totals = {"timing_s/collapse_first_turn_total": 0.0, "timing_s/collapse_multi_turn_total": 0.0}

    def score(self, params: Any, samples: SampleSet) -> np.ndarray:
        """``L_seq[n, N]`` of a sample set, on shapes bucketed so that few programs compile."""
        n, big_n = len(samples.reasonings), len(samples.prompts)
        prompts = _padded(samples.prompts, _bucket(big_n, ROW_BUCKET),
                          _bucket(max(map(len, samples.prompts)), PROMPT_BUCKET), left=True)
        reasonings = _padded(samples.reasonings, _bucket(n, self.row_multiple),
                             _bucket(max(map(len, samples.reasonings)), REASONING_BUCKET), left=False)
        return np.asarray(self.cross(params, *prompts, *reasonings))[:n, :big_n]

    def family(self, name: str, params: Any, samples: SampleSet) -> dict[str, float]:
        if len(samples.prompts) < 2:
            return {}
        same = np.array([[a == b for b in samples.prompts] for a in samples.prompts])
        lengths = np.array([len(z) for z in samples.reasonings])
        metrics, self.ema[name] = pair_metrics(self.score(params, samples), lengths, np.asarray(samples.columns),
                                               same, std_eps=self.config.std_eps, ema=self.ema[name],
                                               ema_decay=self.config.ema_decay)
        return {f"{name}/{key}": value for key, value in metrics.items()}

    def __call__(self, params: Any, traj: Trajectory, step: int) -> dict[str, float]:
        """Every collapse metric of this step (``{}`` off-cadence)."""
        if not self.config.should_compute(step):
            return {}
        pairs, totals = turn_pairs(self.tokenizer, traj, self.chat)
        num_samples = None if self.config.num_samples == "all" else self.config.num_samples
        rng = np.random.default_rng([self.seed, step])
        out = {}
        kept = sum(sum(pair is not None for pair in turns) for turns in pairs)
        if sum(totals):
            out["collapse/valid_thinking_rate"] = kept / sum(totals)
        if self.config.first_turn_enabled:
            start = time.perf_counter()
            valid = sum(1 for turns in pairs if turns and turns[0] is not None)
            out |= {"collapse/first_turn_num_total": float(len(pairs)), "collapse/first_turn_num_valid": float(valid),
                    "collapse/first_turn_valid_rate": valid / len(pairs) if pairs else 0.0}
            try:
                out |= self.family(FIRST_TURN, params, first_turn_set(pairs, traj.group_ids, num_samples, rng))
            except ValueError as error:  # the reference skips the family and logs nothing for it
                log.warning("collapse detection: first-turn family skipped at step %d: %s", step, error)
            out["timing_s/collapse_first_turn_step"] = time.perf_counter() - start
        if self.config.multi_turn_enabled:
            start = time.perf_counter()
            out |= self.family(TRAJECTORY, params, trajectory_set(pairs, num_samples, rng))
            out["timing_s/collapse_multi_turn_step"] = time.perf_counter() - start
        return self._timed(out)

    def _timed(self, out: dict[str, float]) -> dict[str, float]:
        """Adds the cumulative ``timing_s/collapse_*_total`` counters."""
        for key, total in (("timing_s/collapse_first_turn_step", "timing_s/collapse_first_turn_total"),
                           ("timing_s/collapse_multi_turn_step", "timing_s/collapse_multi_turn_total")):
            self.totals[total] += out.get(key, 0.0)
        self.totals["timing_s/collapse_total"] = (self.totals["timing_s/collapse_first_turn_total"]
                                                  + self.totals["timing_s/collapse_multi_turn_total"])
        return out | self.totals
