"""``launch.compile --suggest``: search a configuration whose every program fits the slice's HBM."""

from __future__ import annotations

from typing import Callable

from launch.compile_measure import Row
from launch.compile_report import fits
from runtime import aot
from runtime.mesh import MeshConfig

# Micro-batches this many times smaller, tried after remat.
SHRINK_FACTORS = (1, 2, 4)


def mesh_candidates(devices: int) -> list[MeshConfig]:
    """Every ``data x fsdp x tensor`` factorisation of ``devices``: least tensor parallelism first, then FSDP."""
    sizes = [d for d in range(1, devices + 1) if devices % d == 0]
    meshes = [MeshConfig(d, devices // (d * t), t) for t in sizes for d in sizes if devices % (d * t) == 0]
    return sorted(meshes, key=lambda m: (m.tensor, m.data))


def search_order(remat_given: bool) -> list[tuple[bool, int]]:
    """``(remat, shrink)`` in the order tried: as given, then remat, then remat with smaller micro-batches."""
    options = [(False, 1)] + [(True, shrink) for shrink in SHRINK_FACTORS]
    return [option for option in options if option[0] or not remat_given]


def suggest(measure: Callable[[MeshConfig, bool, int], tuple[list[Row], float]], tpu: aot.Slice,
            max_tries: int, remat_given: bool = False) -> str:
    """The first (mesh, remat, micro-batch) whose programs all fit, searching every mesh, then remat, then
    smaller micro-batches; ``measure(mesh, remat, shrink)`` raises ``ValueError`` for a configuration the
    run cannot use (skipped, not counted as a try)."""
    tries = 0
    for remat, shrink in search_order(remat_given):
        for mesh in mesh_candidates(len(tpu.devices)):
            try:
                measured = measure(mesh, remat, shrink)
            except ValueError:
                continue
            tries += 1
            if fits(*measured, tpu):
                return (f"fits: --mesh {mesh.data},{mesh.fsdp},{mesh.tensor}" + (" remat=True" if remat else "")
                        + (f" with micro-batches {shrink}x smaller" if shrink > 1 else ""))
            if tries >= max_tries:
                return f"no fitting configuration among the {tries} tried (raise --max-tries or use more chips)"
    return f"no fitting configuration among the {tries} tried: use more chips"
