"""A training run's output folder: one writer, one recorded config, one metric history.

Both trainers (``launch.starpo``, ``launch.tdd distil``) follow the same protocol:

1. ``RunFolder(out, config, allow_changes)`` is entered before any model loads. It checks that
   ``out`` is (or can be made) a folder and takes an OS-level lock on ``out/.lock`` for the run's
   lifetime (``flock``: released on any exit, SIGKILL included; on several processes process 0
   holds it); a busy folder is refused naming the holder's host and pid. When ``out`` holds
   checkpoints, ``config`` is compared with the one recorded at the first start (``out/config.json``):
   changed keys stop the run with a diff unless ``allow_changes`` names them.
2. ``resume(ckpt, target, total)`` restores the newest readable checkpoint (unreadable newer ones are
   moved aside), refuses a step count below the steps done, keeps the metric rows up to the restored
   step and records allowed config changes in ``out/config_changes.jsonl``. A start from step 0 moves
   an earlier history (metrics, TensorBoard events, rollouts, config record) to ``out/previous/<n>/``
   instead of appending to it, and records ``config``.
3. ``checkpoint_record`` (the resolved config and the code version) goes into every checkpoint.
"""

from __future__ import annotations

import datetime
import fcntl
import functools
import json
import logging
import os
import socket
import subprocess
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax

from runtime.checkpoint import Checkpointer, NoReadableCheckpoint
from runtime.metrics import TABLES_FILE, keep_rows

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
CHANGES_FILE = "config_changes.jsonl"
LOCK_FILE = ".lock"
HISTORY = ("metrics.jsonl", TABLES_FILE, "events.out.tfevents.*", "rollouts", CONFIG_FILE, CHANGES_FILE)


class RunFolderError(RuntimeError):
    """A run folder that this run must not write to as asked."""


@functools.cache
def code_version() -> str | None:
    """The git commit of this checkout (``+dirty`` with uncommitted changes), or None outside git."""
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; values as JSON reads them back (tuples become lists)."""
    flat = {}
    for key, value in json.loads(json.dumps(tree, default=str)).items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_diff(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{key: (recorded, current)}`` of the dotted keys whose values differ (absent: ``"<absent>"``)."""
    old, new = flatten(recorded), flatten(current)
    return {key: (old.get(key, "<absent>"), new.get(key, "<absent>")) for key in sorted(old.keys() | new.keys())
            if old.get(key, "<absent>") != new.get(key, "<absent>")}


def _allowed(key: str, allow: Sequence[str]) -> bool:
    return any(key == a or key.startswith(a + ".") for a in allow)


class RunLock:
    """An exclusive ``flock`` on ``path`` that records the holder's host and pid in the file."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode("utf-8", "replace").strip() or "an unknown process"
            os.close(fd)
            raise RunFolderError(f"{self.path.parent} is in use by another run ({holder}); wait for it to end "
                                 f"or choose another output folder") from None
        os.ftruncate(fd, 0)
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        os.write(fd, f"host {socket.gethostname()} pid {os.getpid()} since {started}".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


class RunFolder:
    """``out`` of one training run; see the module docstring.

    Args:
      out: the run folder (created if missing).
      config: the run's resolved config as nested dicts (``dataclasses.asdict``).
      allow_changes: dotted config keys (or sections) that may differ from the recorded config on resume.
      ignore: keys never compared (e.g. the output folder's own spelling).
    """

    def __init__(self, out: str | os.PathLike, config: Mapping[str, Any], *, allow_changes: Sequence[str] = (),
                 ignore: Sequence[str] = ()):
        self.out = Path(out)
        self.config = {k: v for k, v in json.loads(json.dumps(config, default=str)).items() if k not in ignore}
        self.allow_changes = tuple(allow_changes)
        self._lock = RunLock(self.out / LOCK_FILE)
        self._changes: dict[str, tuple[Any, Any]] = {}
        keys = flatten(self.config)
        unknown = [a for a in self.allow_changes if not any(_allowed(k, (a,)) for k in keys)]
        if unknown:
            raise ValueError(f"--allow-change names no config key: {unknown}")

    @property
    def checkpoint_record(self) -> dict[str, Any]:
        """What every checkpoint's loop state carries besides the loop position."""
        return {"config": self.config, "code_version": code_version()}

    def __enter__(self) -> "RunFolder":
        check_output(self.out, "output folder", folder=True)
        self.out.mkdir(parents=True, exist_ok=True)
        if jax.process_index() == 0:
            self._lock.acquire()
        try:
            self._check_config()
        except BaseException:
            self._lock.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    def _check_config(self) -> None:
        """Refuses a resume whose config differs from the recorded one outside ``allow_changes``."""
        record = self.out / CONFIG_FILE
        if not _has_checkpoints(self.out) or not record.is_file():
            return
        self._changes = config_diff(json.loads(record.read_text()), self.config)
        refused = {k: v for k, v in self._changes.items() if not _allowed(k, self.allow_changes)}
        if refused:
            lines = "\n".join(f"  {k}: {old!r} -> {new!r}" for k, (old, new) in refused.items())
            raise RunFolderError(
                f"{self.out} holds a run with another config ({record}); changed keys:\n{lines}\n"
                f"resume with the recorded values, choose another output folder, or allow the change with "
                f"--allow-change {','.join(refused)}")

    def resume(self, ckpt: Checkpointer, target: Any, total: int) -> tuple[Any, dict[str, Any], int]:
        """``(state, loop_state, start)``: the newest readable checkpoint, or ``(target, {}, 0)`` on a fresh start.

        Raises ``RunFolderError`` when ``total`` is below the restored step.
        """
        state, loop, start = target, {}, 0
        if ckpt.steps():
            try:
                state, loop, start = ckpt.restore(target, set_aside=True)
            except NoReadableCheckpoint as error:
                log.warning("%s; starting from step 0", error)
        if start > total:
            raise RunFolderError(f"the step count {total} is below the {start} steps already done in {self.out}; "
                                 f"give at least {start}")
        if start == 0:
            self._archive_history()
            self._write_config()
        else:
            if jax.process_index() == 0:
                keep_rows(self.out / "metrics.jsonl", start)
                keep_rows(self.out / TABLES_FILE, start)
            if self._changes or not (self.out / CONFIG_FILE).is_file():
                self._record_changes(start)
        return state, loop, start

    def _write_config(self) -> None:
        if jax.process_index() == 0:
            (self.out / CONFIG_FILE).write_text(json.dumps(self.config, indent=2))

    def _record_changes(self, start: int) -> None:
        """Logs allowed changes (or a first record in a folder from an older version) and rewrites the record."""
        if not self._changes:
            log.warning("%s has checkpoints but no recorded config (an older run folder): recording this one",
                        self.out)
        for key, (old, new) in self._changes.items():
            log.warning("resuming %s from step %d with %s changed: %r -> %r", self.out, start, key, old, new)
        if jax.process_index() == 0 and self._changes:
            with open(self.out / CHANGES_FILE, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": start, "changed": self._changes}) + "\n")
        self._write_config()

    def _archive_history(self) -> None:
        """Moves an earlier run's history to ``out/previous/<n>`` (the first free n) before a fresh start."""
        found = [p for pattern in HISTORY for p in sorted(self.out.glob(pattern))]
        if not found or jax.process_index() != 0:
            return
        previous = self.out / "previous"
        n = 1 + max((int(p.name) for p in previous.glob("*") if p.name.isdigit()), default=0)
        (previous / str(n)).mkdir(parents=True)
        for path in found:
            os.replace(path, previous / str(n) / path.name)
        log.warning("%s held the history of an earlier run without a readable checkpoint: moved %s to %s and "
                    "starting at step 0", self.out, [p.name for p in found], previous / str(n))


def check_output(path: str | os.PathLike, name: str, *, folder: bool = False) -> None:
    """Raises ``ValueError`` naming ``name`` when ``path`` cannot be written as a file (``folder``: a folder).

    Meant for before any model loads: an output that is a folder where a file is due (or the
    reverse), or below an existing file.
    """
    path = Path(path)
    if folder and path.exists() and not path.is_dir():
        raise ValueError(f"{name}: {path} is a file, not a folder")
    if not folder and path.is_dir():
        raise ValueError(f"{name}: {path} is a folder, not a file")
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ValueError(f"{name}: {path} cannot be written: {parent} is a file")


def _has_checkpoints(out: Path) -> bool:
    folder = out / "checkpoints"
    return folder.is_dir() and any(p.name.isdigit() for p in folder.iterdir())
