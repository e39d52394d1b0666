"""Mesh construction from a config and the logical-axis rules."""

import jax
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from runtime.mesh import MeshConfig, logical_to_spec, make_mesh


@pytest.mark.parametrize("config, shape", [
    (MeshConfig(), (1, 8, 1)),
    (MeshConfig(data=2, fsdp=-1, tensor=2), (2, 2, 2)),
    (MeshConfig(data=-1, fsdp=1, tensor=4), (2, 1, 4)),
    (MeshConfig(data=8, fsdp=1, tensor=1), (8, 1, 1)),
])
def test_mesh_shape_and_axis_types(config, shape):
    mesh = make_mesh(config)
    assert tuple(mesh.shape.values()) == shape
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert mesh.axis_types == (AxisType.Auto,) * 3
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


@pytest.mark.parametrize("config, message", [
    (MeshConfig(data=3, fsdp=-1), r"does not divide the 8 devices"),
    (MeshConfig(data=2, fsdp=2, tensor=1), r"uses 4 devices but 8 are available"),
    (MeshConfig(data=-1, fsdp=-1), r"only one mesh axis may be -1.*mesh.data, mesh.fsdp"),
    (MeshConfig(tensor=0), r"mesh.tensor must be a positive integer or -1"),
])
def test_bad_mesh_shape_names_the_problem(config, message):
    with pytest.raises(ValueError, match=message):
        make_mesh(config)


def test_logical_names_map_through_the_rules():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    assert logical_to_spec(("embed", "mlp"), (8, 16), mesh) == P("fsdp", "tensor")
    assert logical_to_spec(("batch", "length", "act_embed"), (4, 3, 8), mesh) == P(("data", "fsdp"), None, None)
    assert logical_to_spec((None, "heads", "head_dim"), (8, 4, 2), mesh) == P(None, "tensor", None)


def test_indivisible_or_repeated_axes_are_replicated():
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
    assert logical_to_spec(("embed", "mlp"), (6, 3), mesh) == P(None, None)
    assert logical_to_spec(("embed", "embed"), (8, 8), mesh) == P("fsdp", None)
    assert logical_to_spec(("conv_kernel", "conv_kernel", "conv_in", "conv_out"), (3, 3, 8, 4), mesh) \
        == P(None, None, "fsdp", "tensor")


def test_unknown_logical_name_and_rank_mismatch_are_errors():
    mesh = make_mesh(MeshConfig())
    with pytest.raises(KeyError, match="'embd' has no entry"):
        logical_to_spec(("embd",), (8,), mesh)
    with pytest.raises(ValueError, match=r"do not match the array shape \(8, 2\)"):
        logical_to_spec(("embed",), (8, 2), mesh)


def test_devices_subset():
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=1), jax.devices()[:2])
    assert mesh.devices.size == 2
