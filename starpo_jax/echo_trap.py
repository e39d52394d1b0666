"""Echo Trap warnings (RAGEN §4.1): reward-variance collapse and gradient-norm spikes.

The paper diagnoses the collapse from a falling ``rollout/in_group_std`` (the early
signal) and spikes in ``actor/grad_norm`` (the irreversible point). The reference
does not detect it in code; this monitor turns both into warnings in the log.
"""

from __future__ import annotations

from typing import Any, Mapping

from runtime.guards import SpikeDetector


class EchoTrapMonitor:
    """Watches per-iteration metrics and returns human-readable warnings.

    Args:
      collapse_ratio: warn when the in-group reward std falls below this fraction of its
        running maximum (after ``warmup`` iterations).
      spike_factor: warn when the actor's gradient norm exceeds this multiple of the
        median of the last ``window`` iterations.
    """

    def __init__(self, collapse_ratio: float = 0.1, spike_factor: float = 5.0, window: int = 20, warmup: int = 5):
        self.collapse_ratio, self.warmup = collapse_ratio, warmup
        self._spikes = SpikeDetector(window=window, factor=spike_factor, min_history=warmup)
        self._max_std = 0.0
        self._seen = 0

    def state_dict(self) -> dict[str, Any]:
        """The monitor's history as JSON, saved in a checkpoint's loop state so a resumed run warns alike."""
        return {"seen": self._seen, "max_std": self._max_std, "grad_norms": self._spikes.history}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._seen, self._max_std = state["seen"], state["max_std"]
        self._spikes.restore(state["grad_norms"])

    def update(self, step: int, metrics: Mapping[str, float]) -> list[str]:
        warnings = []
        self._seen += 1
        std = metrics.get("rollout/in_group_std")
        if std is not None:
            self._max_std = max(self._max_std, std)
            if self._seen > self.warmup and self._max_std > 0 and std < self.collapse_ratio * self._max_std:
                warnings.append(f"Echo Trap warning at step {step}: in-group reward std {std:.4g} fell below "
                                f"{self.collapse_ratio:g} x its peak {self._max_std:.4g} (reward variance collapse)")
        grad_norm = metrics.get("actor/grad_norm")
        if grad_norm is not None and self._spikes.update(grad_norm):
            warnings.append(f"Echo Trap warning at step {step}: actor/grad_norm {grad_norm:.4g} spiked above "
                            f"{self._spikes.factor:g} x its recent median")
        return warnings
