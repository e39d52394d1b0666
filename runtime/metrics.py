"""Scalar metrics to JSONL and TensorBoard, tables to their own JSONL, and a progress display for long loops.

Only process 0 writes; other processes get a writer that does nothing, so launch
scripts call ``write`` unconditionally. Files are opened at the first ``write``, so a
run folder's earlier history can be moved away after the writer is made.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping, NamedTuple

import jax
import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Column
from tensorboardX import SummaryWriter

from runtime.console import CONSOLE
from runtime.wandb_logger import WandbLogger


TABLES_FILE = "tables.jsonl"


class Table(NamedTuple):
    """A logged table (a W&B ``Table`` when wandb logs): column names and one tuple per row."""

    columns: tuple[str, ...]
    rows: list[tuple]


def to_scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Converts a mapping of 0-d arrays / numbers into plain Python floats."""
    host = jax.device_get(dict(metrics))
    scalars = {}
    for name, value in host.items():
        array = np.asarray(value)
        if array.size != 1:
            raise ValueError(f"metric {name!r} is not a scalar: shape {array.shape}")
        scalars[name] = float(array.reshape(()))
    return scalars


class MetricWriter:
    """Writes scalar dicts to ``<logdir>/metrics.jsonl`` and TensorBoard event files.

    ``Table`` values in a row go to ``<logdir>/tables.jsonl`` instead, one line
    ``{"step", "key", "columns", "rows"}`` per table (and to wandb as tables).

    Args:
      logdir: folder for both outputs; created if missing.
      tensorboard: also write TensorBoard event files.
      enabled: defaults to ``jax.process_index() == 0``.
      wandb: an optional ``runtime.wandb_logger.WandbLogger`` that gets every row too (closed with the writer).
    """

    def __init__(self, logdir: str | os.PathLike, *, tensorboard: bool = True, enabled: bool | None = None,
                 wandb: WandbLogger | None = None):
        self.logdir = os.fspath(logdir)
        self.path = os.path.join(self.logdir, "metrics.jsonl")
        self._wandb = wandb
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self.tensorboard = tensorboard
        self._jsonl = None
        self._tb = None

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Writes one row of scalars (and its tables) for ``step``; returns the scalars as floats."""
        tables = {name: value for name, value in metrics.items() if isinstance(value, Table)}
        scalars = to_scalars({name: value for name, value in metrics.items() if name not in tables})
        if not self.enabled:
            return scalars
        if self._jsonl is None:
            os.makedirs(self.logdir, exist_ok=True)
            self._jsonl = open(self.path, "a", encoding="utf-8")
            if self.tensorboard:
                self._tb = SummaryWriter(logdir=self.logdir, flush_secs=10)
        row = {"step": int(step), **{k: (v if math.isfinite(v) else str(v)) for k, v in scalars.items()}}
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for name, value in scalars.items():
                self._tb.add_scalar(name, value, global_step=int(step))
        if tables:
            with open(os.path.join(self.logdir, TABLES_FILE), "a", encoding="utf-8") as f:
                f.writelines(json.dumps({"step": int(step), "key": name, "columns": list(table.columns),
                                         "rows": [list(row) for row in table.rows]}) + "\n"
                             for name, table in tables.items())
        if self._wandb is not None:
            self._wandb.write(step, scalars, tables)
        return scalars

    def discard_after(self, step: int) -> None:
        """Drops the ``metrics.jsonl`` rows of steps after ``step``: a run resumed from checkpoint
        ``step`` writes them again (TensorBoard shows the latest value of a step anyway)."""
        if not self.enabled:
            return
        if self._jsonl is not None:
            self._jsonl.close()
        keep_rows(self.path, step)
        if self._jsonl is not None:
            self._jsonl = open(self.path, "a", encoding="utf-8")

    def flush(self) -> None:
        if self._jsonl is not None:
            self._jsonl.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None

    def __enter__(self) -> "MetricWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Reads a ``metrics.jsonl`` file back into a list of rows."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def keep_rows(path: str | os.PathLike, last_step: int) -> None:
    """Keeps the rows of a ``metrics.jsonl`` file with ``step <= last_step`` (atomic rewrite; no file: nothing)."""
    if not os.path.isfile(path):
        return
    rows = [row for row in read_jsonl(path) if row["step"] <= last_step]
    tmp = os.fspath(path) + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    os.replace(tmp, path)


class ProgressBar:
    """A progress bar with the latest metrics, shown on process 0 only (``total=None``: unknown length).

    Use as a context manager: ``with ProgressBar(total, "train") as bar: bar.update(step, metrics)``.
    Drawn on ``runtime.console.CONSOLE``, so log records print above it. The bar, counts and times keep
    their width in a narrow (80-column) terminal; the metrics, shown by their last name part
    (``train/success`` as ``success``), are cut with an ellipsis instead.
    """

    def __init__(self, total: int | None, description: str = "", *, keys: tuple[str, ...] = (), start: int = 0):
        self.keys = keys
        fixed = lambda width=None: Column(no_wrap=True, min_width=width)
        counts = len(f"{total}/{total}") if total is not None else 7
        self._progress = Progress(
            TextColumn("[bold]{task.description}", table_column=fixed()),
            BarColumn(bar_width=20, table_column=fixed(20)), MofNCompleteColumn(table_column=fixed(counts)),
            TimeElapsedColumn(table_column=fixed(7)), TimeRemainingColumn(table_column=fixed(7)),
            TextColumn("{task.fields[metrics]}", table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1)),
            console=CONSOLE, expand=True, disable=jax.process_index() != 0,
        )
        self._task = self._progress.add_task(description, total=total, completed=start, metrics="")

    def update(self, completed: int, metrics: Mapping[str, float] | None = None) -> None:
        shown = ""
        if metrics:
            shown = "  ".join(f"{k.rsplit('/', 1)[-1]}={metrics[k]:.4g}"
                              for k in (self.keys or tuple(metrics)) if k in metrics)
        self._progress.update(self._task, completed=completed, metrics=shown)

    def __enter__(self) -> "ProgressBar":
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()
