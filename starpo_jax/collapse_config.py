"""RAGEN-2's ``collapse_detection.*`` keys (ragen2.md §3.2), apart from the detector so the config imports them.

Defaults are RAGEN-2's code fallbacks for the two families (both off, as in RAGEN V1, which has no detector)
and ``config/base.yaml``'s for the rest; the ``v2`` presets turn both families on, as ``base.yaml`` does.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class CollapseDetectionConfig:
    """Cadence, sample sets and estimator constants of the template-collapse detector.

    Attributes:
      compute_freq: steps 1, ``compute_freq``, ``2·compute_freq``, … (1-based, as RAGEN-2's ``global_steps``).
      micro_batch_size: RAGEN-2's chunk size for building its cross batch; it does not change the result, and
        here the whole cross matrix is one compiled program, so the key is refused (``config_keys``).
      first_turn_enabled, multi_turn_enabled: the two sample-set families (RAGEN-2 runs when either is on).
      num_samples: pairs per family (an int > 0, or ``"all"``).
      std_eps: the z-score denominator's epsilon.
      ema_decay: decay of the marginal-std EMA.
    """

    compute_freq: int = 5
    micro_batch_size: int = 128
    first_turn_enabled: bool = False
    multi_turn_enabled: bool = False
    num_samples: int | str = 64
    std_eps: float = 1e-3
    ema_decay: float = 0.9

    def __post_init__(self):
        if self.num_samples != "all" and (isinstance(self.num_samples, bool) or not isinstance(self.num_samples, int)
                                          or self.num_samples <= 0):
            raise ValueError(f"collapse_detection.num_samples must be a positive integer or 'all', "
                             f"got {self.num_samples!r}")
        if self.compute_freq < 1:
            raise ValueError(f"collapse_detection.compute_freq must be >= 1, got {self.compute_freq}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"collapse_detection.ema_decay must be in [0, 1), got {self.ema_decay}")
        if self.std_eps <= 0:
            raise ValueError(f"collapse_detection.std_eps must be > 0, got {self.std_eps}")

    @property
    def enabled(self) -> bool:
        """Whether either family runs."""
        return self.first_turn_enabled or self.multi_turn_enabled

    def should_compute(self, step: int) -> bool:
        """RAGEN-2's cadence: never at step 0, always at step 1, then every ``compute_freq`` steps."""
        if not self.enabled or step == 0:
            return False
        return step == 1 or step % self.compute_freq == 0
