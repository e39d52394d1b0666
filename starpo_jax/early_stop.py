"""RAGEN-2's early-stop triggers: empty filtered batches, reward-variance collapse, failing validation (ragen2.md §4.8).

- ``rollout_filter_empty_stop_steps`` consecutive steps whose filter kept nothing (0 disables);
- reward-variance collapse: the mean ``rollout/in_group_reward_std`` of the first 10 non-empty steps is the
  base; once 10 later steps in a row are all below a tenth of it, stop;
- a validation success below 1 % for 5 validations in a row, per ``val/<tag>/success`` key (RAGEN-2's
  ``val-env/<tag>/success``).

Each trigger logs its ``early_stopped/*`` metric as 1.0; the trainer then saves and ends the run.
"""

from __future__ import annotations

import collections
from typing import Mapping

BASE_STEPS = WINDOW = 10
COLLAPSE_FRACTION = 0.1
LOW_SUCCESS, LOW_SUCCESS_VALIDATIONS = 0.01, 5


class EarlyStop:
    """The triggers' counters; each ``observe_*`` returns the metrics to log (``early_stopped/*`` when stopping)."""

    def __init__(self, empty_stop_steps: int, reward_variance_collapse: bool = True,
                 low_validation_success: bool = True):
        """``empty_stop_steps`` 0 and the two switches off disable the triggers one by one."""
        self.empty_stop_steps = empty_stop_steps
        self.reward_variance_collapse, self.low_validation_success = reward_variance_collapse, low_validation_success
        self.consecutive_empty = 0
        self.base_values: list[float] = []
        self.window: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.low_success: dict[str, int] = collections.defaultdict(int)
        self.stopped = False

    def observe_filter(self, empty: bool, in_group_reward_std: float | None) -> dict[str, float]:
        """After the rollout filter: the empty-batch counter and, on non-empty steps, the variance monitor."""
        metrics = {"rollout/empty_after_filter": float(empty)}
        if empty:
            self.consecutive_empty += 1
            metrics["rollout/consecutive_empty_after_filter_steps"] = float(self.consecutive_empty)
            if 0 < self.empty_stop_steps <= self.consecutive_empty:
                return self._stop(metrics, "early_stopped/empty_filtered_steps")
            return metrics
        self.consecutive_empty = 0
        metrics["rollout/consecutive_empty_after_filter_steps"] = 0.0
        if in_group_reward_std is None or not self.reward_variance_collapse:
            return metrics
        if len(self.base_values) < BASE_STEPS:
            self.base_values.append(in_group_reward_std)
            return metrics
        self.window.append(in_group_reward_std)
        base = sum(self.base_values) / BASE_STEPS
        if len(self.window) == WINDOW and all(v < COLLAPSE_FRACTION * base for v in self.window):
            return self._stop(metrics, "early_stopped/reward_variance_collapse")
        return metrics

    def observe_validation(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """After an in-loop validation: per-tag counters of success below 1 %."""
        if not self.low_validation_success:
            return {}
        for key, value in metrics.items():
            if key.startswith(("val/", "val-env/")) and key.endswith("/success"):  # ours, RAGEN-2's prefix
                self.low_success[key] = self.low_success[key] + 1 if value < LOW_SUCCESS else 0
        if any(count >= LOW_SUCCESS_VALIDATIONS for count in self.low_success.values()):
            return self._stop({}, "early_stopped/low_validation_success")
        return {}

    def _stop(self, metrics: dict[str, float], name: str) -> dict[str, float]:
        self.stopped = True
        return metrics | {name: 1.0}
