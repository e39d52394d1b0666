"""Sharded forward and backward on 8 fake devices equal the single-device ones (with remat on)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from runtime.mesh import MeshConfig, make_mesh
from runtime.sharding import shard_batch, shard_state
from starpo_jax.models.config import TransformerConfig
from starpo_jax.models.transformer import CausalLM
from starpo_hf_fixtures import numpy_initialised

CONFIG = TransformerConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=8, model_type="llama")


def token_log_likelihood(graphdef, params, tokens, mask):
    """Mean log-probability of each next valid token (the quantity a policy-gradient step differentiates)."""
    logits, _ = nnx.merge(graphdef, params)(tokens, mask)
    log_probs = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    picked = jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)[..., 0]
    weights = mask[:, 1:] * mask[:, :-1]
    return jnp.sum(picked * weights) / jnp.sum(weights)


@pytest.fixture(scope="module")
def host_params():
    """One random initialisation shared by every mesh (NumPy: a JAX init compiles slowly on CPU)."""
    return numpy_initialised(lambda: CausalLM(CONFIG, rngs=nnx.Rngs(0)))[1]


def run(params, mesh_shape, remat):
    data, fsdp, tensor = mesh_shape
    mesh = make_mesh(MeshConfig(data, fsdp, tensor), jax.devices()[: data * fsdp * tensor])
    config = dataclasses.replace(CONFIG, remat=remat)
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, CONFIG.vocab_size, (8, 10)).astype(np.int32)
    mask = (np.arange(10)[None] >= rng.integers(0, 6, (8, 1))).astype(np.int32)
    with nnx.use_eager_sharding(False):
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0))))
    with jax.set_mesh(mesh):
        params = shard_state(params, mesh)
        tokens, mask = shard_batch((tokens, mask), mesh)
        loss, grads = jax.jit(jax.value_and_grad(token_log_likelihood, argnums=1), static_argnums=0)(
            graphdef, params, tokens, mask)
    return float(loss), jax.device_get(grads), params


@pytest.fixture(scope="module")
def reference(host_params):
    return run(host_params, (1, 1, 1), remat=False)


@pytest.mark.parametrize("mesh_shape", [(2, 4, 1), (1, 2, 4)])
def test_sharded_forward_backward_equals_single_device(host_params, reference, mesh_shape):
    ref_loss, ref_grads, _ = reference
    loss, grads, params = run(host_params, mesh_shape, remat=True)
    np.testing.assert_allclose(loss, ref_loss, atol=1e-6, rtol=0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5), grads, ref_grads)
    up = params["model"]["layers"]["mlp"]["up_proj"]["kernel"].get_value()
    _, fsdp, tensor = mesh_shape
    assert up.sharding.shard_shape(up.shape) == (CONFIG.num_layers, 32 // fsdp, 48 // tensor)
