"""Multi-host start-up: ``jax.distributed.initialize`` when the launch is multi-process.

A launch is multi-process when flags say so, when the ``JAX_COORDINATOR_ADDRESS`` /
``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` variables are set, or when the usual
variables of a SLURM job, a TPU pod slice or an Open MPI launch name more than one
process. On one process it does nothing. On CPU it selects gloo collectives.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

import jax


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Explicit multi-process settings; ``None`` fields are read from the environment."""

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    initialization_timeout: int = 300


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def resolve(config: DistributedConfig, environ: Mapping[str, str] = os.environ) -> DistributedConfig | None:
    """Returns the settings to initialise with, or ``None`` for a single-process launch.

    Explicit fields win over ``JAX_*`` variables. For SLURM, TPU pods and Open MPI
    the returned config may leave fields ``None``: JAX's own cluster detection fills them.
    """
    explicit = dataclasses.replace(
        config,
        coordinator_address=config.coordinator_address or environ.get("JAX_COORDINATOR_ADDRESS") or None,
        num_processes=config.num_processes if config.num_processes is not None
        else _env_int(environ, "JAX_NUM_PROCESSES"),
        process_id=config.process_id if config.process_id is not None else _env_int(environ, "JAX_PROCESS_ID"),
    )
    if explicit.num_processes is not None:
        if explicit.num_processes < 1:
            raise ValueError(f"distributed.num_processes must be >= 1, got {explicit.num_processes}")
        if explicit.num_processes == 1:
            return None
        missing = [f"distributed.{name}" for name in ("coordinator_address", "process_id")
                   if getattr(explicit, name) is None]
        if missing:
            raise ValueError(f"a {explicit.num_processes}-process launch needs {' and '.join(missing)} "
                             "(or JAX_COORDINATOR_ADDRESS / JAX_PROCESS_ID)")
        if not 0 <= explicit.process_id < explicit.num_processes:
            raise ValueError(f"distributed.process_id={explicit.process_id} is outside "
                             f"[0, {explicit.num_processes})")
        return explicit
    cluster_sizes = (
        _env_int(environ, "SLURM_NTASKS") if "SLURM_JOB_ID" in environ else None,
        _env_int(environ, "OMPI_COMM_WORLD_SIZE"),
        len(environ["TPU_WORKER_HOSTNAMES"].split(",")) if environ.get("TPU_WORKER_HOSTNAMES") else None,
    )
    if any(size is not None and size > 1 for size in cluster_sizes):
        return explicit
    return None


def initialize(config: DistributedConfig = DistributedConfig(),
               environ: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """Starts ``jax.distributed`` for a multi-process launch; a no-op on one process.

    Must run before any other JAX call touches a backend.

    Returns:
      ``(process_index, process_count)``.
    """
    settings = resolve(config, environ)
    if settings is not None and not jax.distributed.is_initialized():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=settings.coordinator_address,
            num_processes=settings.num_processes,
            process_id=settings.process_id,
            local_device_ids=list(settings.local_device_ids) if settings.local_device_ids else None,
            initialization_timeout=settings.initialization_timeout,
        )
    return jax.process_index(), jax.process_count()
