"""Atomic, sharded checkpoints of a train state plus a JSON dict of loop state (orbax).

Each step is one folder ``<directory>/<step>/`` with two items: ``state`` (any
pytree of arrays: parameters, optimizer state, step, RNG keys) and ``loop`` (JSON:
data position, environment seeds, counters). Orbax writes into a temporary folder
and renames it when complete, so an interrupted save is never taken as a
checkpoint. Restores land directly on the shardings of a target state; a trainer's
restore moves an unreadable step aside to ``<directory>.unreadable/`` (never deletes
it), so the step can be written again.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

log = logging.getLogger(__name__)


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _keys_to_data(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _abstract(target: Any) -> Any:
    """Shape, dtype and sharding of every array of ``target`` (RNG keys as their raw data)."""
    def one(x):
        if _is_key(x):
            data = jax.eval_shape(jax.random.key_data, x)
            return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=x.sharding)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)

    return jax.tree.map(one, target)


def _data_to_keys(restored: Any, target: Any) -> Any:
    return jax.tree.map(
        lambda r, t: jax.random.wrap_key_data(r, impl=jax.random.key_impl(t)) if _is_key(t) else r,
        restored, target)


class NoReadableCheckpoint(RuntimeError):
    """Every checkpoint of a folder failed to restore."""


class Checkpointer:
    """Saves and restores ``(state, loop_state)`` pairs, keeping the last ``max_to_keep``.

    Args:
      directory: checkpoint root folder (created if missing).
      max_to_keep: number of most recent checkpoints kept; older ones are deleted.
      async_save: write in a background thread (call ``wait`` before exiting).
      create: create ``directory`` if missing; ``False`` (readers) raises ``FileNotFoundError`` instead.
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 3, async_save: bool = False,
                 create: bool = True):
        if max_to_keep < 1:
            raise ValueError(f"checkpoint.max_to_keep must be >= 1, got {max_to_keep}")
        self.directory = os.path.abspath(os.fspath(directory))
        if not create and not os.path.isdir(self.directory):
            raise FileNotFoundError(f"no checkpoint folder {self.directory}")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=create, enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "loop"))

    def save(self, step: int, state: Any, loop_state: dict[str, Any] | None = None) -> None:
        """Writes checkpoint ``step`` (overwriting nothing: an existing step raises)."""
        if step in self._manager.all_steps():
            raise FileExistsError(f"checkpoint step {step} already exists in {self.directory}")
        self._manager.save(int(step), args=ocp.args.Composite(
            state=ocp.args.StandardSave(_keys_to_data(state)),
            loop=ocp.args.JsonSave(dict(loop_state or {}))), force=True)

    def wait(self) -> None:
        """Blocks until a background save has finished."""
        self._manager.wait_until_finished()

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk, oldest first."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def set_aside(self, step: int) -> str:
        """Moves checkpoint ``step`` to ``<directory>.unreadable/<step>`` (a free name); returns where it went.

        Process 0 moves it; on several processes all wait for the move before reading the steps again.
        """
        aside = self.directory + ".unreadable"
        target = os.path.join(aside, str(step))
        if os.path.exists(target):
            target += f".{time.time_ns()}"
        if jax.process_index() == 0:
            os.makedirs(aside, exist_ok=True)
            os.replace(os.path.join(self.directory, str(step)), target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"checkpoint step {step} set aside")
        self._manager.reload()
        return target

    def restore(self, target: Any, step: int | None = None, *,
                set_aside: bool = False) -> tuple[Any, dict[str, Any], int]:
        """Restores a checkpoint onto the shardings of ``target``.

        Args:
          target: a state with the structure, shapes, dtypes and shardings to restore into.
          step: which checkpoint; default the latest readable one. If the latest is
            corrupted, falls back to the previous one with a warning.
          set_aside: move each unreadable checkpoint passed over aside (``set_aside``), so
            that a resumed run can write its step again.

        Returns:
          ``(state, loop_state, step)``.
        """
        candidates = [step] if step is not None else self.steps()[::-1]
        if not candidates:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        if step is not None and step not in self.steps():
            raise FileNotFoundError(f"checkpoint step {step} not found in {self.directory} (have {self.steps()})")
        abstract = _abstract(target)
        errors = []
        for candidate in candidates:
            try:
                restored = self._manager.restore(candidate, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), loop=ocp.args.JsonRestore()))
            except Exception as error:  # a partially written or corrupted step: try the previous one
                if step is not None:
                    raise
                log.warning("checkpoint step %d in %s is unreadable (%s); falling back to the previous one",
                            candidate, self.directory, error)
                if set_aside:
                    log.warning("moved unreadable checkpoint step %d to %s", candidate, self.set_aside(candidate))
                errors.append(f"step {candidate}: {error}")
                continue
            return _data_to_keys(restored.state, target), dict(restored.loop), candidate
        raise NoReadableCheckpoint(f"no readable checkpoint in {self.directory}: " + "; ".join(errors))

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
