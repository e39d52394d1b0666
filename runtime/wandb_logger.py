"""Optional Weights & Biases logging, RAGEN's ``trainer.logger=[console,wandb]``.

``wandb`` is not a requirement of this project: selecting it without the package installed stops the run
before anything is loaded, with the command that fixes it. ``console`` stands for what every run writes
anyway (progress bar, ``metrics.jsonl``, TensorBoard). Only process 0 logs.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Mapping, Sequence

import jax

LOGGERS = ("console", "wandb")


def check_loggers(loggers: Sequence[str], key: str = "trainer.logger") -> None:
    """Raises naming ``key`` for an unknown logger, or for ``wandb`` when the package is missing."""
    unknown = [name for name in loggers if name not in LOGGERS]
    if unknown:
        raise ValueError(f"{key} has unknown loggers {unknown}; choose from {list(LOGGERS)}")
    if "wandb" in loggers and importlib.util.find_spec("wandb") is None:
        raise ImportError(f"{key} includes 'wandb' but the wandb package is not installed: `pip install wandb` "
                          f"(and `wandb login`, or WANDB_MODE=offline), or drop it: {key}=[console]")


class WandbLogger:
    """A W&B run whose ``write(step, scalars)`` mirrors ``MetricWriter.write`` (see ``MetricWriter(wandb=…)``).

    Args:
      project, name: the run's project and name (RAGEN: ``trainer.project_name``, ``trainer.experiment_name``).
      config: the run's configuration, stored with it.
      logdir: where wandb keeps its local files (``<logdir>/wandb``).
    """

    def __init__(self, project: str, name: str, config: Mapping[str, Any], logdir: str | os.PathLike):
        self._run = None
        if jax.process_index() == 0:
            import wandb

            self._run = wandb.init(project=project, name=name, config=dict(config), dir=os.fspath(logdir))

    def write(self, step: int, scalars: Mapping[str, float], tables: Mapping[str, Any] | None = None) -> None:
        """Logs ``scalars`` and ``tables`` (``runtime.metrics.Table``s, as W&B tables) at ``step``."""
        if self._run is not None:
            import wandb

            row = dict(scalars) | {name: wandb.Table(columns=list(table.columns), data=[list(r) for r in table.rows])
                                   for name, table in (tables or {}).items()}
            self._run.log(row, step=int(step))

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
