"""The resumable distillation loop shared by ``launch.tdd distil`` and the digits demo.

A checkpoint holds the whole ``DistillState`` (parameters, optimizer state, step, RNG key, EMA) and
the loop state ``{"step", "data_position"}``; batches come from ``tdd_jax.data.cache_batches`` (or
``tdd_jax.fresh_crops.crop_batches``) started at ``data_position``, so a resumed run draws the same batches and keys as an uninterrupted one.
Metric rows written after the restored step (by a run killed before its next checkpoint) are dropped
from ``metrics.jsonl`` on resume. SIGTERM saves a checkpoint at the next step boundary and returns.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterator

from jax.sharding import Mesh

from runtime.checkpoint import Checkpointer
from runtime.guards import NonFiniteError, NonFiniteGuard
from runtime.metrics import MetricWriter, ProgressBar, read_jsonl
from runtime.preemption import PreemptionHandler
from runtime.sharding import shard_batch
from tdd_jax.data import cache_batches
from tdd_jax.distill import DistillBatch, DistillState, FrozenParams, Unconditional


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keeps the rows of ``metrics.jsonl`` with ``step <= last_step`` (atomic rewrite)."""
    if not path.is_file():
        return
    rows = [row for row in read_jsonl(path) if row["step"] <= last_step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    os.replace(tmp, path)


def distil_loop(step: Callable, state: DistillState, frozen: FrozenParams, uncond: Unconditional,
                data: DistillBatch, mesh: Mesh, *, steps: int, batch_size: int, seed: int, out: Path,
                checkpoint_every: int | None, description: str = "distil",
                max_consecutive_non_finite: int = 5,
                non_finite_keys: tuple[str, ...] = ("numerics/consecutive_non_finite",),
                stream: Callable[[int], Iterator] | None = None) -> tuple[Any, dict[str, float]]:
    """Runs ``step`` until ``steps`` (resuming from ``out/checkpoints``); ``checkpoint_every=None``: no checkpoints.

    ``state`` is a ``DistillState`` or any pytree the step carries (TDD-adv: ``AdversarialState``, whose
    discriminator is checkpointed with it). Returns the final state and the last metric row. Raises
    ``NonFiniteError`` after ``max_consecutive_non_finite`` consecutive skipped steps counted by any of
    ``non_finite_keys``, having saved the unchanged state. Batches come from ``stream(data_position)``
    (default ``cache_batches`` of ``data``; ``latent_cache=none``: ``fresh_crops.crop_batches``).
    """
    guard = NonFiniteGuard(max_consecutive_non_finite, non_finite_keys)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = Checkpointer(out / "checkpoints", max_to_keep=2) if checkpoint_every is not None else None
    start, position = 0, 0
    if ckpt is not None and ckpt.latest_step() is not None:
        state, loop, start = ckpt.restore(state)
        position = int(loop["data_position"])
    truncate_metrics(out / "metrics.jsonl", start)
    batches = stream(position) if stream else cache_batches(data, batch_size, seed, start=position)
    last: dict[str, Any] = {}

    def checkpoint(done: int) -> None:
        ckpt.save(done, state, {"step": done, "data_position": done})

    try:
        with MetricWriter(out) as writer, PreemptionHandler() as preemption, \
                ProgressBar(steps, description, keys=("loss", "grad_norm"), start=start) as bar:
            for i in range(start, steps):
                state, metrics = step(state, frozen, uncond, shard_batch(next(batches), mesh))
                last = writer.write(i + 1, metrics)
                bar.update(i + 1, last)
                stop = preemption.requested()
                due = ckpt is not None and (stop or i + 1 == steps or
                                            (checkpoint_every and (i + 1) % checkpoint_every == 0))
                if due:
                    checkpoint(i + 1)
                try:
                    guard.check(i + 1, last)
                except NonFiniteError:  # skipped updates left the last finite state: keep it
                    if ckpt is not None:
                        if not due:
                            checkpoint(i + 1)
                        logging.error("saved the last finite state as checkpoint %d in %s", i + 1, ckpt.directory)
                    raise
                if stop:
                    break
    finally:
        if ckpt is not None:
            ckpt.close()
    return state, last
