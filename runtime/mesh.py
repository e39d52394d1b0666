"""Device meshes and the one logical-axis rules table of the project.

Parameters and activations are annotated with *logical* axis names (``embed``,
``mlp``, ``heads`` ...). ``LOGICAL_AXIS_RULES`` maps each name onto the mesh axes
``data``, ``fsdp`` and ``tensor``; only the mesh shape changes between one CPU,
eight fake CPU devices, one GPU and a TPU pod slice.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# Logical name -> mesh axis (or tuple of mesh axes, or None = replicated).
LOGICAL_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
    # activations
    "batch": ("data", "fsdp"),
    "length": None,
    "act_embed": None,
    "act_heads": "tensor",
    "act_mlp": "tensor",
    # transformer parameters
    "embed": "fsdp",
    "vocab": "tensor",
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "layers": None,
    "norm": None,
    "lora_rank": None,
    "value": None,
    # convolution parameters (kernels are (kh, kw, conv_in, conv_out))
    "conv_kernel": None,
    "conv_in": "fsdp",
    "conv_out": "tensor",
}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the ``data``, ``fsdp`` and ``tensor`` mesh axes; one may be -1 (inferred)."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1

    @classmethod
    def parse(cls, text: str, flag: str = "--mesh") -> "MeshConfig":
        """``"data,fsdp,tensor"`` from a command line, e.g. ``"1,-1,1"``."""
        parts = text.split(",")
        if len(parts) != 3 or not all(p.strip().lstrip("-").isdigit() for p in parts):
            raise ValueError(f"{flag} must be three integers data,fsdp,tensor (one may be -1), got {text!r}")
        return cls(*(int(p) for p in parts))

    def shape(self, num_devices: int) -> tuple[int, int, int]:
        """Resolves the -1 entry and checks that the shape uses exactly ``num_devices``."""
        sizes = dict(data=self.data, fsdp=self.fsdp, tensor=self.tensor)
        for name, size in sizes.items():
            if not isinstance(size, int) or size == 0 or size < -1:
                raise ValueError(f"mesh.{name} must be a positive integer or -1, got {size!r}")
        inferred = [name for name, size in sizes.items() if size == -1]
        if len(inferred) > 1:
            raise ValueError(f"only one mesh axis may be -1, got -1 for {', '.join('mesh.' + n for n in inferred)}")
        known = math.prod(size for size in sizes.values() if size != -1)
        if inferred:
            if num_devices % known:
                raise ValueError(
                    f"mesh shape {self._describe()} does not divide the {num_devices} devices: "
                    f"the fixed axes multiply to {known}")
            sizes[inferred[0]] = num_devices // known
        elif known != num_devices:
            raise ValueError(
                f"mesh shape {self._describe()} uses {known} devices but {num_devices} are available")
        return sizes["data"], sizes["fsdp"], sizes["tensor"]

    def _describe(self) -> str:
        return f"(data={self.data}, fsdp={self.fsdp}, tensor={self.tensor})"


def make_mesh(config: MeshConfig = MeshConfig(), devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds a ``Mesh`` over ``devices`` (default: all devices) with Auto axis types."""
    devices = list(jax.devices() if devices is None else devices)
    shape = config.shape(len(devices))
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: dict[str, Any] = LOGICAL_AXIS_RULES) -> PartitionSpec:
    """Maps logical axis names of one array onto a ``PartitionSpec`` of ``mesh``.

    A dimension is replicated when its name maps to no mesh axis, when the mesh
    axes do not divide it evenly, or when an earlier dimension already uses them.
    """
    if len(names) != len(shape):
        raise ValueError(f"logical axes {tuple(names)} do not match the array shape {tuple(shape)}")
    used: set[str] = set()
    spec = []
    for name, size in zip(names, shape):
        if name is not None and name not in rules:
            raise KeyError(f"logical axis {name!r} has no entry in the rules table (known: {sorted(rules)})")
        target = rules.get(name) if name is not None else None
        axes = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
        axes = tuple(a for a in axes if a in mesh.shape and a not in used)
        if not axes or size % math.prod(mesh.shape[a] for a in axes):
            spec.append(None)
            continue
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def logical_sharding(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                     rules: dict[str, Any] = LOGICAL_AXIS_RULES) -> NamedSharding:
    """``NamedSharding`` for one array from its logical axis names."""
    return NamedSharding(mesh, logical_to_spec(names, shape, mesh, rules))


def replicated(mesh: Mesh) -> NamedSharding:
    """Sharding that keeps a full copy on every device of ``mesh``."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, ndim: int = 1, rules: dict[str, Any] = LOGICAL_AXIS_RULES) -> NamedSharding:
    """Sharding for an array whose leading dimension is the batch."""
    batch = rules["batch"]
    return NamedSharding(mesh, PartitionSpec(batch, *([None] * (ndim - 1))))
