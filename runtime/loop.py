"""The resumable training loop shared by StarPO and TDD: checkpoint cadence, stop signals, non-finite stop.

``resumable_loop`` runs ``step_fn`` from ``start`` (the step a ``RunFolder.resume`` restored, whose metric rows
after it are already dropped) to ``num_steps``. After each step it writes the metric row, saves a checkpoint
every ``save_every`` steps, at the last step and when a stop signal arrived (SIGTERM / SIGINT:
``runtime.preemption``, then exit code ``PREEMPTED_EXIT_CODE``), and stops with ``NonFiniteError`` once
``guard`` sees too many skipped updates in a row, having saved the last finite state.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Mapping

from runtime.guards import NonFiniteError, NonFiniteGuard
from runtime.metrics import MetricWriter, ProgressBar
from runtime.preemption import PreemptionHandler

log = logging.getLogger(__name__)


def resumable_loop(step_fn: Callable[[Any, int], tuple[Any, Mapping[str, Any]]], state: Any, start: int,
                   num_steps: int, checkpoint_fn: Callable[[int, Any], None] | None, *, writer: MetricWriter,
                   guard: NonFiniteGuard, preemption: PreemptionHandler, save_every: int = 0,
                   checkpoint_dir: Path | None = None, description: str = "", bar_keys: tuple[str, ...] = (),
                   on_row: Callable[[int, dict[str, float]], None] | None = None,
                   stop_after: Callable[[], bool] | None = None) -> tuple[Any, dict[str, float]]:
    """Runs ``state, metrics = step_fn(state, i)`` for ``i`` in ``[start, num_steps)``; returns the state and last row.

    Args:
      checkpoint_fn: ``checkpoint_fn(done, state)`` saves after ``done`` steps; ``None``: no checkpoints.
      writer: gets each step's metrics as row ``i + 1``.
      guard: raises ``NonFiniteError`` on the row of too many consecutive skipped updates.
      preemption: the entered handler whose stop request ends the loop after a checkpoint.
      save_every: checkpoint cadence in steps; ``<= 0``: only at the last step and on a stop.
      checkpoint_dir: named in the log and the stop message.
      on_row: called with ``(i + 1, row)`` after the row is written.
      stop_after: asked after each step; ``True`` ends the run there, after a checkpoint (early stopping).
    """
    last: dict[str, float] = {}
    with ProgressBar(num_steps, description, keys=bar_keys, start=start) as bar:
        for i in range(start, num_steps):
            state, metrics = step_fn(state, i)
            done = i + 1
            last = writer.write(done, metrics)
            if on_row is not None:
                on_row(done, last)
            bar.update(done, last)
            stop = preemption.requested()  # asked once: a signal between two asks would skip the save
            early = stop_after is not None and stop_after()
            cadence = save_every > 0 and done % save_every == 0
            due = checkpoint_fn is not None and (stop or early or done == num_steps or cadence)
            if due:
                checkpoint_fn(done, state)
            try:
                guard.check(done, last)
            except NonFiniteError:  # skipped updates left the last finite state: keep it
                if checkpoint_fn is not None:
                    if not due:
                        checkpoint_fn(done, state)
                    log.error("saved the last finite state as checkpoint %d in %s", done, checkpoint_dir)
                raise
            if stop:
                raise preemption.stop(f"saved checkpoint {done} in {checkpoint_dir}" if checkpoint_fn is not None
                                      else f"stopped after step {done} (checkpoints are off: nothing saved)")
            if early:
                log.warning("early stop after step %d", done)
                break
    return state, last
