"""A sharded functional NNX train step equals the single-device one, and traces once."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from runtime.mesh import MeshConfig, batch_sharding, make_mesh
from runtime.sharding import create_sharded, shard_batch
from runtime.train_state import compile_step, init_train_state, scan_micro_batches
from runtime_fixtures import TinyMLP, make_step


def run(mesh_shape, steps=3):
    data, fsdp, tensor = mesh_shape
    devices = jax.devices()[: data * fsdp * tensor]
    mesh = make_mesh(MeshConfig(data, fsdp, tensor), devices)
    with jax.set_mesh(mesh):
        model = create_sharded(lambda: TinyMLP(nnx.Rngs(0)), mesh)
        graphdef, params = nnx.split(model)
        tx = optax.adamw(1e-2)
        state = init_train_state(params, tx, jax.random.key(0), mesh)
        raw_step = chex.assert_max_traces(make_step(graphdef, tx), n=1)
        step = compile_step(raw_step, state, batch_sharding(mesh, 2), batch_sharding(mesh, 2))
        rng = np.random.default_rng(0)
        losses = []
        for _ in range(steps):
            x, y = shard_batch((rng.normal(size=(16, 16)).astype(np.float32),
                                rng.normal(size=(16, 8)).astype(np.float32)), mesh)
            state, metrics = step(state, x, y)
            losses.append(float(metrics["loss"]))
    chex.clear_trace_counter()
    return losses, jax.device_get(state.params), state


@pytest.fixture(scope="module")
def reference():
    return run((1, 1, 1))


@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (2, 4, 1), (1, 2, 4)])
def test_sharded_step_equals_single_device(reference, mesh_shape):
    ref_losses, ref_params, _ = reference
    losses, params, state = run(mesh_shape)
    np.testing.assert_allclose(losses, ref_losses, atol=1e-6, rtol=0)
    chex.assert_trees_all_close(params, ref_params, atol=1e-6, rtol=0)
    assert int(state.step) == 3
    kernel = state.params["up"]["kernel"].get_value()
    assert len(kernel.sharding.device_set) == np.prod(mesh_shape)
    data, fsdp, tensor = mesh_shape
    assert kernel.sharding.shard_shape(kernel.shape) == (16 // fsdp, 32 // tensor)
    adam = state.opt_state[0]  # Adam's moments are sharded like the parameters, counters replicated
    for moment in (adam.mu, adam.nu):
        assert moment["up"]["kernel"].get_value().sharding == kernel.sharding
    assert adam.count.sharding.is_fully_replicated and len(adam.count.sharding.device_set) == np.prod(mesh_shape)


def test_step_traces_once_for_repeated_calls():
    with pytest.raises(AssertionError, match="traced"):
        mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
        with jax.set_mesh(mesh):
            model = create_sharded(lambda: TinyMLP(nnx.Rngs(0)), mesh)
            graphdef, params = nnx.split(model)
            tx = optax.sgd(0.1)
            state = init_train_state(params, tx, jax.random.key(0), mesh)
            step = compile_step(chex.assert_max_traces(make_step(graphdef, tx), n=1), state,
                                batch_sharding(mesh, 2), batch_sharding(mesh, 2))
            for n in (4, 4, 8):
                state, _ = step(state, *shard_batch((np.ones((n, 16), np.float32), np.ones((n, 8), np.float32)), mesh))
    chex.clear_trace_counter()


@pytest.mark.parametrize("length", [1, 3])
def test_scan_micro_batches_equals_lax_scan(length):
    xs = {"a": np.arange(length * 4, dtype=np.float32).reshape(length, 4), "b": np.ones((length, 2), np.float32)}

    def body(carry, x):
        return carry + jnp.sum(x["a"]) * x["b"], {"mean": jnp.mean(x["a"]), "row": x["a"] * 2.0}

    init = np.zeros(2, np.float32)
    expected = jax.lax.scan(body, init, xs)
    got = jax.jit(scan_micro_batches, static_argnums=0)(body, init, xs)
    chex.assert_trees_all_close(got, expected)
    chex.assert_trees_all_equal_shapes(got, expected)
