"""Guards for long runs: skip non-finite updates, stop after too many, flag gradient spikes.

``skip_non_finite`` wraps an optax optimizer with ``optax.apply_if_finite`` so a
step whose gradients hold a NaN or Inf leaves parameters and optimizer state
unchanged (and never gives up on its own); ``NonFiniteGuard`` is the host-side
rule that stops the run after ``max_consecutive`` such steps in a row.
"""

from __future__ import annotations

import collections
import math
from typing import Any, Mapping

import jax
import numpy as np
import optax

_NEVER = int(np.iinfo(np.int32).max)


def skip_non_finite(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` that ignores (and counts) updates whose gradients are not finite."""
    return optax.apply_if_finite(tx, max_consecutive_errors=_NEVER)


def non_finite_metrics(opt_state: Any) -> dict[str, jax.Array]:
    """Counters of a ``skip_non_finite`` optimizer state, for the metric writer."""
    states = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.ApplyIfFiniteState))
              if isinstance(s, optax.ApplyIfFiniteState)]
    if len(states) != 1:
        raise ValueError(f"expected one skip_non_finite optimizer state, found {len(states)}")
    return {"numerics/non_finite_steps": states[0].total_notfinite,
            "numerics/consecutive_non_finite": states[0].notfinite_count}


class NonFiniteError(RuntimeError):
    """Raised when too many consecutive steps had non-finite gradients."""


class NonFiniteGuard:
    """Stops a run after ``max_consecutive`` consecutive skipped steps.

    ``keys``: the metrics holding consecutive-skip counters (e.g. one per optimizer); the largest counts.
    """

    def __init__(self, max_consecutive: int = 5, keys: tuple[str, ...] = ("numerics/consecutive_non_finite",)):
        if max_consecutive < 1:
            raise ValueError(f"max_consecutive_non_finite must be >= 1, got {max_consecutive}")
        self.max_consecutive, self.keys = max_consecutive, keys

    def check(self, step: int, metrics: Mapping[str, float]) -> None:
        consecutive = max((int(metrics[key]) for key in self.keys if key in metrics), default=0)
        if consecutive >= self.max_consecutive:
            raise NonFiniteError(
                f"{consecutive} consecutive steps up to step {step} had non-finite gradients "
                f"(limit {self.max_consecutive}); parameters are those of the last finite step")


class SpikeDetector:
    """Flags a value above ``factor`` times the median of the previous ``window`` values.

    Used for gradient-norm spikes, the irreversible point of the Echo Trap (RAGEN §4.1).
    """

    def __init__(self, window: int = 20, factor: float = 5.0, min_history: int = 5):
        self.factor = factor
        self.min_history = min_history
        self._history: collections.deque[float] = collections.deque(maxlen=window)

    @property
    def history(self) -> list[float]:
        """The finite values the median is taken over, oldest first (to save with a checkpoint)."""
        return list(self._history)

    def restore(self, history: list[float]) -> None:
        """Replaces the history with values saved from ``history``."""
        self._history.clear()
        self._history.extend(history)

    def update(self, value: float) -> bool:
        spike = (len(self._history) >= self.min_history and math.isfinite(value)
                 and value > self.factor * float(np.median(self._history)))
        if math.isfinite(value):
            self._history.append(value)
        return spike
