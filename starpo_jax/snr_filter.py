"""RAGEN-2's SNR-aware rollout filter: score each group, keep an adaptive set of groups (ragen2.md §4).

Groups are the ``num_groups`` consecutive blocks of the group-contiguous batch. Each gets a score
``s_g`` (``rollout_filter_metric``: the reward std by default — the signal-to-noise proxy), and a
strategy keeps some of them: ``top_p`` (linear: the best groups until ``p`` of the summed score;
softmax: until ``p`` of the softmax mass), ``top_k`` (a fraction of all groups), ``top_k_abs`` (a
count) or ``min_p`` (within a ratio of the best). Unlike StarPO-S's fixed ``k`` (``filtering``), the
number kept varies per step and may be zero (the step is then skipped). Selection runs on the host:
the kept rows are gathered there anyway, and ``adjust_batch_size`` brings the count back to a few
shapes.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

STRATEGIES = ("top_p", "top_k", "top_k_abs", "min_p")
FILTER_TYPES = ("largest", "smallest")
PROB_MODES = ("linear", "softmax")
METRICS = ("reward_variance", "reward", "reward_sum", "entropy", "entropy_variance", "length")
METRIC_ALIASES = {"reward_std": "reward_variance", "entropy_std": "entropy_variance"}
ZERO = 1e-10


@dataclasses.dataclass(frozen=True)
class SnrFilterConfig:
    """The ``actor_rollout_ref.rollout.rollout_filter_*`` keys of RAGEN-2 (``config/base.yaml`` defaults)."""

    strategy: str = "top_p"
    value: float = 1.0
    filter_type: str = "largest"
    include_zero: bool = True
    top_p_prob_mode: str = "linear"
    selection_eps: float = 0.01
    metric: str = "reward_variance"

    def __post_init__(self):
        prefix = "actor_rollout_ref.rollout.rollout_filter_"
        object.__setattr__(self, "metric", canonical_metric(self.metric))
        for name, allowed in (("strategy", STRATEGIES), ("filter_type", FILTER_TYPES),
                              ("top_p_prob_mode", PROB_MODES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{prefix}{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not math.isfinite(self.value) or self.value < 0:
            raise ValueError(f"{prefix}value must be a finite number >= 0, got {self.value!r}")

    @property
    def is_noop(self) -> bool:
        """``top_p`` with ``p >= 1`` and zero-score groups included returns the batch unmodified."""
        return self.strategy == "top_p" and self.value >= 1 and self.include_zero


def canonical_metric(name: str | None) -> str:
    """The metric name after RAGEN-2's aliases and lower-casing (None is the reward std)."""
    name = "reward_variance" if name is None else METRIC_ALIASES.get(name.lower(), name.lower())
    if name not in METRICS:
        raise ValueError(f"actor_rollout_ref.rollout.rollout_filter_metric must be one of "
                         f"{METRICS + tuple(METRIC_ALIASES)}, got {name!r}")
    return name


def group_statistics(values: np.ndarray) -> dict[str, np.ndarray]:
    """Per-group ``std`` (ddof 1; 0 for one-sample groups), ``max``, ``mean`` and ``sum`` of ``values[G, n]``."""
    std = values.std(axis=1, ddof=1) if values.shape[1] > 1 else np.zeros(values.shape[0])
    return {"std": std, "max": values.max(axis=1), "mean": values.mean(axis=1), "sum": values.sum(axis=1)}


def group_scores(metric: str, values: np.ndarray) -> np.ndarray:
    """``s_g`` of ``values[G, n]``: per-trajectory reward, mean token entropy or token count (ragen2.md §4.3)."""
    stats = group_statistics(values)
    return {"reward_variance": stats["std"], "entropy_variance": stats["std"], "reward": stats["mean"],
            "entropy": stats["mean"], "length": stats["mean"], "reward_sum": stats["sum"]}[canonical_metric(metric)]


def _top_p_linear(scores: np.ndarray, p: float, eps: float) -> int:
    """How many of the sorted ``scores`` the linear rule keeps (0: nothing reaches ``τ = p·Σs − ε``)."""
    threshold, total, count = np.float32(p) * scores.sum() - np.float32(eps), np.float32(0.0), 0
    for score in scores:
        if total >= threshold or score <= 0:
            break
        total += score
        count += 1
    return count if total >= threshold else 0


def _top_p_softmax(scores: np.ndarray, p: float) -> int:
    weights = np.exp(scores - scores.max())
    cumulative = np.cumsum(np.sort(weights / weights.sum())[::-1])
    return min(int(np.searchsorted(cumulative, p, side="left")) + 1, len(scores))


def select_groups(scores: np.ndarray, config: SnrFilterConfig, num_groups: int | None = None) -> list[int]:
    """The kept group ids, ascending (``RolloutFilter._select_top_groups``, ragen2.md §4.4).

    Scores and thresholds are float32, as the reference's tensors (``min_p``'s ``1e-10`` vanishes there); ties
    go to the lower group id (a stable sort; torch's order is unspecified).
    """
    scores = np.asarray(scores, np.float32)
    num_groups = len(scores) if num_groups is None else num_groups
    candidates = np.arange(len(scores)) if config.include_zero else np.flatnonzero(np.abs(scores) > ZERO)
    if not len(candidates):
        return []
    s = scores[candidates]
    largest = config.filter_type == "largest"
    order = np.argsort(-s if largest else s, kind="stable")
    if config.strategy == "top_p":
        if config.value >= 1:
            return candidates.tolist()
        if config.top_p_prob_mode == "softmax":
            count = _top_p_softmax(s if largest else -s, config.value)
        else:
            count = _top_p_linear(s[order], config.value, config.selection_eps)
    elif config.strategy == "top_k":
        count = max(min(int(config.value * num_groups), len(s)), 1)
    elif config.strategy == "top_k_abs":
        count = max(1, min(int(config.value), len(s)))
    else:
        value = np.float32(config.value)
        keep = s >= s.max() * value - ZERO if largest else s <= s.min() / (value + ZERO) + ZERO
        return sorted(candidates[keep].tolist())
    return sorted(candidates[order[:count]].tolist())


class SnrSelection:
    """One step's filter result: kept groups, the row mask over the batch and RAGEN-2's metrics."""

    def __init__(self, config: SnrFilterConfig, values: np.ndarray, rewards: np.ndarray):
        """``values[G, n]``: the metric's per-trajectory values; ``rewards[G, n]``: the trajectory scores."""
        num_groups, group_size = values.shape
        scores = group_scores(config.metric, values)
        self.groups = list(range(num_groups)) if config.is_noop else select_groups(scores, config, num_groups)
        chosen = np.zeros(num_groups, bool)
        chosen[self.groups] = True
        self.row_mask = np.repeat(chosen, group_size)
        reward_stats = group_statistics(rewards)
        self.reward_std = np.repeat(reward_stats["std"], group_size)  # pre-filter, per sample
        self.metrics = self._metrics(config.metric, group_statistics(values), reward_stats, chosen, scores)
        self.kept_ratio = len(self.groups) / num_groups

    @staticmethod
    def _metrics(metric: str, stats: dict, reward_stats: dict, chosen: np.ndarray, scores: np.ndarray) -> dict:
        def mean(x, where):
            return float(x[where].mean()) if where.any() else 0.0

        family = metric.removesuffix("_variance").removesuffix("_sum")
        source, keys = (reward_stats, ("std", "max", "mean", "sum")) if family == "reward" else (stats, ("std", "max", "mean"))
        out = {}
        for prefix, where in (("rollout/in_group_", np.ones_like(chosen)), ("rollout/chosen_in_group_", chosen)):
            out |= {f"{prefix}{k}": mean(stats[k], where) for k in ("std", "max", "mean")}
            out |= {f"{prefix}{family}_{k}": mean(source[k], where) for k in keys}
        return out | {"rollout/filter_kept_count": float(chosen.sum()),
                      "rollout/filter_kept_ratio": float(chosen.mean()),
                      "rollout/filter_zero_count": float(np.sum(np.abs(scores) <= ZERO))}


def adjust_batch_size(rows: np.ndarray, divisor: int, mode: str, rng: np.random.Generator) -> np.ndarray:
    """Row indices brought to a multiple of ``divisor`` (``agent_proxy.batch_adjust_mode``, ragen2.md §4.5).

    ``copy`` appends randomly chosen rows (without replacement when enough exist), ``delete`` drops
    random rows; the batch order of the rest is kept.
    """
    remainder = len(rows) % divisor
    if remainder == 0 or not len(rows):
        return rows
    if mode == "copy":
        extra = divisor - remainder
        return np.concatenate([rows, rng.choice(rows, extra, replace=extra > len(rows))])
    if mode == "delete":
        drop = rng.choice(len(rows), remainder, replace=False)
        return np.delete(rows, drop)
    raise ValueError(f"agent_proxy.batch_adjust_mode must be 'copy' or 'delete', got {mode!r}")


def filter_loss_scale(mode: str, kept_ratio: float) -> float:
    """The advantage factor of ``actor.filter_loss_scaling`` (``none`` 1, ``linear`` ρ, ``sqrt`` √ρ)."""
    scales = {"none": 1.0, "linear": kept_ratio, "sqrt": math.sqrt(kept_ratio)}
    if mode not in scales:
        raise ValueError(f"actor_rollout_ref.actor.filter_loss_scaling must be one of {tuple(scales)}, got {mode!r}")
    return scales[mode]


def soft_reweight(group_std: np.ndarray) -> np.ndarray:
    """GRPO's soft advantage weights ``σ_g / (max σ + 1e-6)`` (``algorithm.soft_advantage_reweight``, §4.7)."""
    return group_std / (group_std.max() + 1e-6)
