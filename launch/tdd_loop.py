"""The resumable distillation loop shared by ``launch.tdd distil`` and the digits demo.

A checkpoint holds the whole ``DistillState`` (parameters, optimizer state, step, RNG key, EMA) and
the loop state ``{"step", "data_position"}``; batches come from ``tdd_jax.data.cache_batches`` (or
``tdd_jax.fresh_crops.crop_batches``) started at ``data_position``, so a resumed run draws the same batches and
keys as an uninterrupted one.
With checkpoints the loop resumes through the run folder's protocol (``runtime.run_folder``): unreadable
checkpoints are moved aside, metric rows written after the restored step (by a run killed before its next
checkpoint) are dropped, and an earlier history without a checkpoint is moved to ``previous/``.
SIGTERM or SIGINT saves a checkpoint at the next step boundary and exits with ``PREEMPTED_EXIT_CODE``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

from jax.sharding import Mesh

from runtime.checkpoint import Checkpointer
from runtime.guards import NonFiniteGuard
from runtime.loop import resumable_loop
from runtime.metrics import MetricWriter, keep_rows
from runtime.preemption import PreemptionHandler
from runtime.run_folder import RunFolder
from runtime.sharding import shard_batch
from tdd_jax.data import cache_batches
from tdd_jax.distill import DistillBatch, DistillState, FrozenParams, Unconditional


def distil_loop(step: Callable, state: DistillState, frozen: FrozenParams, uncond: Unconditional,
                data: DistillBatch, mesh: Mesh, *, steps: int, batch_size: int, seed: int, out: Path,
                checkpoint_every: int | None, description: str = "distil",
                max_consecutive_non_finite: int = 5,
                non_finite_keys: tuple[str, ...] = ("numerics/consecutive_non_finite",),
                run: RunFolder | None = None,
                stream: Callable[[int], Iterator] | None = None) -> tuple[Any, dict[str, float]]:
    """Runs ``step`` until ``steps`` (resuming from ``out/checkpoints``); ``checkpoint_every=None``: no checkpoints.

    ``state`` is a ``DistillState`` or any pytree the step carries (TDD-adv: ``AdversarialState``, whose
    discriminator is checkpointed with it). ``run``: the entered ``RunFolder`` of ``out``, required with
    checkpoints. Batches come from ``stream(data_position)`` (default ``cache_batches`` of ``data``;
    ``latent_cache=none``: ``fresh_crops.crop_batches``). Returns the final state and the last metric row. Raises
    ``NonFiniteError`` after ``max_consecutive_non_finite`` consecutive skipped steps counted by any of
    ``non_finite_keys``, having saved the unchanged state, and ``Preempted`` after a stop signal.
    """
    if checkpoint_every is not None and run is None:
        raise ValueError("distil_loop: checkpoints need the entered RunFolder of out (run=...)")
    guard = NonFiniteGuard(max_consecutive_non_finite, non_finite_keys)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = Checkpointer(out / "checkpoints", max_to_keep=2) if checkpoint_every is not None else None
    start, position = 0, 0
    if ckpt is not None:
        state, loop, start = run.resume(ckpt, state, steps)
        position = int(loop["data_position"]) if start else 0
    else:
        keep_rows(out / "metrics.jsonl", 0)
    batches = stream(position) if stream else cache_batches(data, batch_size, seed, start=position)

    def checkpoint(done: int, state) -> None:
        ckpt.save(done, state, {"step": done, "data_position": done, **run.checkpoint_record})

    def one_step(state, i: int):
        return step(state, frozen, uncond, shard_batch(next(batches), mesh))

    try:
        with MetricWriter(out) as writer, PreemptionHandler() as preemption:
            state, last = resumable_loop(one_step, state, start, steps, checkpoint if ckpt is not None else None,
                                         writer=writer, guard=guard, preemption=preemption,
                                         save_every=checkpoint_every or 0,
                                         checkpoint_dir=ckpt.directory if ckpt is not None else None,
                                         description=description, bar_keys=("loss", "grad_norm"))
    finally:
        if ckpt is not None:
            ckpt.close()
    return state, last
