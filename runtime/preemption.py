"""SIGTERM / SIGINT → checkpoint at the next step boundary → exit with ``PREEMPTED_EXIT_CODE``.

Preemptible TPU VMs and SLURM send SIGTERM before killing a job. The handler
only sets a flag; the training loop asks ``requested()`` after each step, saves
and raises ``Preempted``, which exits the process with ``PREEMPTED_EXIT_CODE``
(75, ``EX_TEMPFAIL``: "try again later"), not 0, so a scheduler can requeue the
job instead of recording it as finished. On several processes the flag is agreed
on (any process asking stops all), so every process saves the same step.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType

import jax
import numpy as np
from jax.experimental import multihost_utils

PREEMPTED_EXIT_CODE = 75


class Preempted(SystemExit):
    """A run stopped by a signal after saving; exits the process with ``PREEMPTED_EXIT_CODE``."""

    def __init__(self, message: str):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.message = message

    def __str__(self) -> str:
        return self.message


class PreemptionHandler:
    """Context manager that turns the given signals into a stop request (a second SIGINT interrupts at once)."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.signals = signals
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.received == "SIGINT":
            raise KeyboardInterrupt  # a second Ctrl-C does not wait for the step boundary
        self.received = signal.Signals(signum).name

    def requested(self) -> bool:
        """Whether any process received a stop signal (a collective on several processes)."""
        if jax.process_count() == 1:
            return self.received is not None
        return bool(np.any(multihost_utils.process_allgather(np.array(self.received is not None))))

    def stop(self, saved: str) -> Preempted:
        """Logs the stop and what was ``saved``; returns the exception for the loop to raise."""
        message = (f"{self.received or 'a stop signal on another process'}: {saved}; exiting with code "
                   f"{PREEMPTED_EXIT_CODE} (preempted: rerun the same command to resume)")
        logging.getLogger(__name__).warning(message)
        return Preempted(message)

    def __enter__(self) -> "PreemptionHandler":
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
