"""SIGTERM → checkpoint at the next step boundary → clean exit.

Preemptible TPU VMs and SLURM send SIGTERM before killing a job. The handler
only sets a flag; the training loop asks ``requested()`` after each step, saves
and returns. On several processes the flag is agreed on (any process asking
stops all), so every process saves the same step.
"""

from __future__ import annotations

import signal
from types import FrameType

import jax
import numpy as np
from jax.experimental import multihost_utils


class PreemptionHandler:
    """Context manager that turns the given signals into a stop request."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)):
        self.signals = signals
        self._requested = False
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._requested = True

    def requested(self) -> bool:
        """Whether any process received a stop signal (a collective on several processes)."""
        if jax.process_count() == 1:
            return self._requested
        return bool(np.any(multihost_utils.process_allgather(np.array(self._requested))))

    def __enter__(self) -> "PreemptionHandler":
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
