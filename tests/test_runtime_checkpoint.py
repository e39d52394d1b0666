"""Orbax checkpoints of a sharded train state: bit-identical restore, keep-last-k, fallback."""

import logging
import os

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from runtime.checkpoint import Checkpointer
from runtime.mesh import MeshConfig, batch_sharding, make_mesh
from runtime.sharding import create_sharded, shard_batch
from runtime.train_state import compile_step, init_train_state
from runtime_fixtures import TinyMLP, make_step


def build_state(mesh, seed):
    model = create_sharded(lambda: TinyMLP(nnx.Rngs(seed)), mesh)
    graphdef, params = nnx.split(model)
    tx = optax.adamw(1e-2)
    return graphdef, tx, init_train_state(params, tx, jax.random.key(seed), mesh)


@pytest.fixture(scope="module")
def mesh():
    mesh = make_mesh(MeshConfig(2, 4, 1))
    with jax.set_mesh(mesh):
        yield mesh


@pytest.fixture(scope="module")
def trained(mesh):
    graphdef, tx, state = build_state(mesh, seed=0)
    step = compile_step(make_step(graphdef, tx), state, batch_sharding(mesh, 2), batch_sharding(mesh, 2))
    rng = np.random.default_rng(0)
    states = []
    for _ in range(5):
        batch = shard_batch((rng.normal(size=(8, 16)).astype(np.float32),
                             rng.normal(size=(8, 8)).astype(np.float32)), mesh)
        state, _ = step(state, *batch)
        states.append(jax.device_get(state))
    return state, states


def leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_restore_is_bit_identical_with_same_shardings(tmp_path, mesh, trained):
    state, _ = trained
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(5, state, {"data_position": 40, "env_seed": 10016})
    _, _, target = build_state(mesh, seed=1)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        restored, loop, step = ckpt.restore(target)
    assert step == 5 and loop == {"data_position": 40, "env_seed": 10016}
    leaves_equal(restored, state)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
    kernel = restored.params["up"]["kernel"].get_value()
    assert kernel.sharding.shard_shape(kernel.shape) == (4, 32)


def test_keep_last_k_deletes_oldest(tmp_path, trained):
    _, states = trained
    with Checkpointer(tmp_path / "ckpt", max_to_keep=2) as ckpt:
        for i, s in enumerate(states, start=1):
            ckpt.save(i, s)
        assert ckpt.steps() == [4, 5]
        with pytest.raises(FileExistsError, match="step 5"):
            ckpt.save(5, states[-1])
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["4", "5"]


def test_corrupted_latest_falls_back_to_previous(tmp_path, mesh, trained, caplog):
    _, states = trained
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(3, states[2], {"i": 3})
        ckpt.save(4, states[3], {"i": 4})
    for root, _, files in os.walk(tmp_path / "ckpt" / "4" / "state"):
        for name in files:
            with open(os.path.join(root, name), "wb") as f:
                f.write(b"garbage")
    _, _, target = build_state(mesh, seed=1)
    with Checkpointer(tmp_path / "ckpt") as ckpt, caplog.at_level(logging.WARNING):
        restored, loop, step = ckpt.restore(target)
    assert step == 3 and loop == {"i": 3}
    leaves_equal(restored, states[2])
    assert "step 4" in caplog.text and "falling back" in caplog.text


def test_missing_checkpoint_is_a_clear_error(tmp_path, trained):
    state, _ = trained
    with Checkpointer(tmp_path / "empty") as ckpt:
        with pytest.raises(FileNotFoundError, match="no checkpoint in"):
            ckpt.restore(state)
        with pytest.raises(FileNotFoundError, match="step 7 not found"):
            ckpt.restore(state, step=7)
