"""Ahead-of-time compilation for TPU slices from a machine without a TPU.

``libtpu`` describes a TPU slice (``jax.experimental.topologies``) and runs the real TPU compiler on
``jax.ShapeDtypeStruct`` arguments that carry their shardings, so nothing is allocated or downloaded.
``measure`` turns a compiled program into per-device HBM (``memory_analysis``) and FLOPs / bytes
accessed (``cost_analysis``); ``roofline`` turns those into a step-time bound from the chip's peaks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from runtime.mesh import MeshConfig, make_mesh
from runtime.sharding import state_shardings


@dataclasses.dataclass(frozen=True)
class Chip:
    """Peak figures of one TPU chip: bf16 FLOP/s, HBM bytes and HBM bytes/s, and where they come from."""

    name: str
    peak_flops: float
    hbm_bytes: float
    hbm_bandwidth: float
    source: str


# Google Cloud's TPU system-architecture pages, "key specifications" tables (read 6 Dec 2026 through the
# project's search tool): peak bf16 compute per chip, HBM capacity and bandwidth per chip. v4 and v5p chips
# hold two TensorCores; libtpu exposes v4's as two devices (``Slice.devices_per_chip``), v5p's as one.
CHIPS: dict[str, Chip] = {
    "v4": Chip("TPU v4", 275e12, 32 * 2**30, 1200e9,
               "cloud.google.com/tpu/docs/v4: 275 teraflops bf16, HBM2 32 GiB, 1200 GBps"),
    "v5e": Chip("TPU v5e", 197e12, 16e9, 819e9,
                "cloud.google.com/tpu/docs/v5e: 197 TFLOPs bf16, HBM2 16 GB, 819 GBps"),
    "v5p": Chip("TPU v5p", 459e12, 95e9, 2765e9,
                "cloud.google.com/tpu/docs/v5p: 459 TFLOPs bf16, HBM2e 95 GB (95 GiB in a later revision), 2765 GBps"),
    "v6e": Chip("TPU v6e", 918e12, 32e9, 1638e9,
                "cloud.google.com/tpu/docs/v6e: 918 TFLOPs bf16, HBM 32 GB, 1638 GBps"),
}
TOPOLOGY_PATTERN = re.compile(r"^(v4|v5e|v5p|v6e):(\d+)x(\d+)(?:x(\d+))?$")
TOPOLOGY_HELP = ("a TPU generation and chip grid: v5e:2x4 (v5e-8), v5e:4x4, v5e:16x16 (v5e-256), v6e:2x4, "
                 "v4:2x2x1 (v4-8), v4:2x2x4 (v4-32), v5p:2x2x1 (v5p-8), v5p:2x2x2; v5e/v6e grids are 2-D, "
                 "v4/v5p grids 3-D")


@dataclasses.dataclass(frozen=True)
class Slice:
    """A described TPU slice: its devices (v4 exposes each of a chip's two TensorCores as a device)."""

    name: str
    chip: Chip
    devices: tuple[Any, ...]
    chips: int
    hosts: int

    @property
    def devices_per_chip(self) -> int:
        return len(self.devices) // self.chips

    @property
    def device_hbm(self) -> float:
        return self.chip.hbm_bytes / self.devices_per_chip

    @property
    def device_peak_flops(self) -> float:
        return self.chip.peak_flops / self.devices_per_chip

    @property
    def device_bandwidth(self) -> float:
        return self.chip.hbm_bandwidth / self.devices_per_chip


def describe_slice(name: str) -> Slice:
    """The TPU slice ``name`` (see ``TOPOLOGY_HELP``); a bad name raises before libtpu is loaded."""
    match = TOPOLOGY_PATTERN.match(name)
    if match is None or (match[1] in ("v5e", "v6e")) != (match[4] is None):
        raise ValueError(f"--topology {name!r} is not {TOPOLOGY_HELP}")
    chips = math.prod(int(g) for g in match.groups()[1:] if g is not None)
    if not 1 <= chips <= 256:
        raise ValueError(f"--topology {name!r} has {chips} chips; 1 to 256 are supported")
    # libtpu takes a lock file meant for a TPU host's one process; describing a slice touches no chip.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies
    try:
        topology = topologies.get_topology_desc(topology_name=name, platform="tpu")
    except Exception as error:  # libtpu raises JaxRuntimeError / RuntimeError for grids it does not know
        raise ValueError(f"--topology {name!r}: libtpu does not describe this slice ({error})") from None
    devices = tuple(topology.devices)
    return Slice(name, CHIPS[match[1]], devices, chips, len({d.process_index for d in devices}))


def slice_mesh(tpu: Slice, config: MeshConfig) -> Mesh:
    """The project's ``data, fsdp, tensor`` mesh over the slice's devices."""
    return make_mesh(config, tpu.devices)


def abstract_state(state: Any, mesh: Mesh) -> Any:
    """An NNX state of ``ShapeDtypeStruct``s placed on the shardings its logical annotations ask for."""
    shardings = state_shardings(state, mesh)
    is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731

    def one(value, sharding):
        value = value.get_value() if is_variable(value) else value
        sharding = sharding.get_value() if is_variable(sharding) else sharding
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)

    return jax.tree.map(one, state, shardings, is_leaf=is_variable)


@dataclasses.dataclass(frozen=True)
class Measure:
    """Per-device bytes of one compiled program and its FLOPs / HBM bytes accessed (per device)."""

    arguments: float
    outputs: float
    temporaries: float
    total: float
    flops: float
    bytes_accessed: float

    def __add__(self, other: "Measure") -> "Measure":
        return Measure(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def scale(self, factor: float) -> "Measure":
        return Measure(*(factor * a for a in dataclasses.astuple(self)))


_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_OUT_OF_MEMORY = re.compile(r"HLO temporaries \(([\d.]+)([KMGT])\)")


def compile_and_measure(lowered: Any, argument_bytes: float) -> Measure:
    """``measure(lowered.compile())``; when the TPU compiler refuses a program that does not fit, the
    temporaries it asked for, with ``argument_bytes`` (per device), and no cost."""
    try:
        return measure(lowered.compile())
    except jax.errors.JaxRuntimeError as error:
        found = _OUT_OF_MEMORY.search(str(error))
        if "RESOURCE_EXHAUSTED" not in str(error) or found is None:
            raise
        temporaries = float(found[1]) * _UNITS[found[2]]
        return Measure(argument_bytes, 0.0, temporaries, argument_bytes + temporaries, 0.0, 0.0)


@dataclasses.dataclass
class Compiler:
    """``compile_and_measure`` with a result cache and an optional share of the work.

    ``cache``: a folder of one JSON ``Measure`` per program, keyed by the lowered program's text, the
    devices it is placed on and the jax / libtpu versions, so a rerun (or another process) compiles
    nothing twice. ``share = (i, n)``: this process compiles only every n-th program from the i-th on
    (into the cache) and answers the others with zeros; ``launch.compile --jobs n`` runs n such
    processes, then the table from the filled cache. ``compiled`` counts the programs it compiled.
    """

    cache: Path | None = None
    share: tuple[int, int] | None = None
    compiled: int = 0
    _seen: int = 0

    def key(self, lowered: Any, devices: Any) -> str:
        placement = [(d.device_kind, getattr(d, "coords", None), getattr(d, "core_on_chip", None)) for d in devices]
        versions = jax.__version__, importlib.metadata.version("libtpu")
        return hashlib.sha256(repr((lowered.as_text(), placement, versions)).encode()).hexdigest()

    def __call__(self, lowered: Any, argument_bytes: float, devices: Any) -> Measure:
        index, self._seen = self._seen, self._seen + 1
        path = None if self.cache is None else self.cache / f"{self.key(lowered, devices)}.json"
        if path is not None and path.is_file():
            return Measure(**json.loads(path.read_text()))
        if self.share is not None and index % self.share[1] != self.share[0]:
            return Measure(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        measured = compile_and_measure(lowered, argument_bytes)
        self.compiled += 1
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(dataclasses.asdict(measured)))
            tmp.replace(path)
        return measured


def measure(compiled: Any) -> Measure:
    """Memory and cost analysis of a compiled program; donated (aliased) outputs are not counted twice.

    XLA's cost analysis counts a loop body once whatever its trip count: callers scale loops themselves.
    """
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    outputs = memory.output_size_in_bytes - memory.alias_size_in_bytes
    total = (memory.argument_size_in_bytes + outputs + memory.temp_size_in_bytes
             + memory.generated_code_size_in_bytes)
    return Measure(memory.argument_size_in_bytes, outputs, memory.temp_size_in_bytes, total,
                   float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)))


def roofline(flops: float, bytes_accessed: float, tpu: Slice) -> tuple[float, float]:
    """``(step seconds, MFU bound)``: the slower of compute at peak and HBM traffic at full bandwidth,
    and the fraction of that time the compute alone needs (no overlap loss, no communication)."""
    compute, memory = flops / tpu.device_peak_flops, bytes_accessed / tpu.device_bandwidth
    seconds = max(compute, memory)
    return seconds, (compute / seconds if seconds else 0.0)
