"""Echo Trap and template-collapse warnings (RAGEN §4.1, RAGEN-2 §3): what the metrics say went wrong.

The paper diagnoses the Echo Trap from a falling ``rollout/in_group_std`` (the early
signal) and spikes in ``actor/grad_norm`` (the irreversible point). RAGEN-2 adds template
collapse: reasoning that stays diverse (the conditional entropy ``H(Z|X)`` holds) but stops
depending on the input (the mutual-information z-score falls), which entropy alone cannot see
(ragen2.md §3.1). The references log the signals; this monitor turns them into warnings in the log.
"""

from __future__ import annotations

from typing import Any, Mapping

from runtime.guards import SpikeDetector


# The collapse family the template warning reads (RAGEN-2's trajectory-uniform sample set, then the first turns).
COLLAPSE_FAMILIES = ("collapse_trajectory_sample", "collapse_first_turn_sample")


class EchoTrapMonitor:
    """Watches per-iteration metrics and returns human-readable warnings.

    Args:
      collapse_ratio: warn when the in-group reward std falls below this fraction of its
        running maximum (after ``warmup`` iterations).
      spike_factor: warn when the actor's gradient norm exceeds this multiple of the
        median of the last ``window`` iterations.
      mi_ratio: warn of template collapse when ``mi_zscore_ema`` falls below this fraction of its
        peak while ``conditional_entropy_est`` stays at ``entropy_ratio`` or more of its value at that peak.
    """

    def __init__(self, collapse_ratio: float = 0.1, spike_factor: float = 5.0, window: int = 20, warmup: int = 5,
                 mi_ratio: float = 0.5, entropy_ratio: float = 0.8):
        self.collapse_ratio, self.warmup = collapse_ratio, warmup
        self.mi_ratio, self.entropy_ratio = mi_ratio, entropy_ratio
        self._spikes = SpikeDetector(window=window, factor=spike_factor, min_history=warmup)
        self._max_std = 0.0
        self._seen = 0
        self._peak_mi: tuple[float, float] | None = None  # (mi_zscore_ema, conditional entropy) at the MI peak

    def state_dict(self) -> dict[str, Any]:
        """The monitor's history as JSON, saved in a checkpoint's loop state so a resumed run warns alike."""
        return {"seen": self._seen, "max_std": self._max_std, "grad_norms": self._spikes.history,
                "peak_mi": self._peak_mi}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._seen, self._max_std = state["seen"], state["max_std"]
        self._spikes.restore(state["grad_norms"])
        peak = state.get("peak_mi")  # absent in checkpoints of older versions
        self._peak_mi = None if peak is None else tuple(peak)

    def _template_collapse(self, step: int, metrics: Mapping[str, float]) -> list[str]:
        family = next((f for f in COLLAPSE_FAMILIES if f"{f}/mi_zscore_ema" in metrics), None)
        if family is None:
            return []
        mi, entropy = metrics[f"{family}/mi_zscore_ema"], metrics[f"{family}/conditional_entropy_est"]
        if self._peak_mi is None or mi > self._peak_mi[0]:
            self._peak_mi = (mi, entropy)
            return []
        peak, peak_entropy = self._peak_mi
        if peak > 0 and mi < self.mi_ratio * peak and entropy >= self.entropy_ratio * peak_entropy:
            return [f"template collapse warning at step {step}: {family}/mi_zscore_ema {mi:.4g} fell below "
                    f"{self.mi_ratio:g} x its peak {peak:.4g} while the reasoning entropy H(Z|X) stays at "
                    f"{entropy:.4g} (was {peak_entropy:.4g}): the reasoning no longer depends on the input"]
        return []

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
        return warnings + self._template_collapse(step, metrics)
