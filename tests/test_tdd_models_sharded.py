"""The UNet (with LoRA, remat and scanned transformer blocks) runs sharded on 8 fake devices with the unsharded,
unrolled loss and gradients."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from runtime.mesh import MeshConfig, make_mesh
from runtime.sharding import shard_batch, shard_state, shardings_of
from tdd_jax.models.lora import LoraConfig, add_lora
from tdd_jax.models.unet import UNet2DConditionModel, UNetConfig

# One level keeps the compile short; it still has resnets, transformers of two blocks, the mid block and text_time.
CFG = UNetConfig(down_block_types=("CrossAttnDownBlock2D",), up_block_types=("CrossAttnUpBlock2D",),
                 block_out_channels=(32,), layers_per_block=(1,), transformer_layers_per_block=(2,),
                 num_attention_heads=(2,), cross_attention_dim=(16,), norm_num_groups=8, use_linear_projection=True,
                 addition_embed_type="text_time", addition_time_embed_dim=4,
                 projection_class_embeddings_input_dim=8 + 6 * 4)


def lora_unet(cfg):
    """Structure only (no tracing, no per-shape compiles) with LoRA on the reference targets."""
    with nnx.use_eager_sharding(False):
        unet = UNet2DConditionModel(cfg, rngs=None)
    add_lora(unet, LoraConfig(rank=4, alpha=4.0), nnx.Rngs(1))
    return nnx.split(unet)


def loss_and_grads(graphdef, mesh_shape, state, batch):
    mesh = make_mesh(MeshConfig(*mesh_shape), jax.devices()[: int(np.prod(mesh_shape))])
    with jax.set_mesh(mesh):
        state = shard_state(state, mesh)
        batch = shard_batch(batch, mesh)

        def loss_fn(state):
            unet = nnx.merge(graphdef, state)
            return jnp.mean(unet(*batch[:3], batch[3]) ** 2)

        step = jax.jit(jax.value_and_grad(loss_fn), in_shardings=(shardings_of(state),),
                       out_shardings=(None, shardings_of(state)))
        loss, grads = step(state)
    return float(loss), jax.device_get(grads), state


def test_sharded_forward_backward_equals_single_device():
    graphdef, abstract = lora_unet(CFG)
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda s: (0.2 * rng.normal(size=s.shape)).astype(np.float32), abstract)
    batch = (rng.normal(size=(4, 8, 8, 4)).astype(np.float32), np.array([1, 250, 500, 999], np.int32),
             rng.normal(size=(4, 5, 16)).astype(np.float32),
             {"text_embeds": rng.normal(size=(4, 8)).astype(np.float32),
              "time_ids": np.tile(np.array([[8, 8, 0, 0, 8, 8]], np.float32), (4, 1))})
    ref_loss, ref_grads, _ = loss_and_grads(graphdef, (1, 1, 1), state, batch)
    for scan_layers in (False, True):
        remat_graphdef, _ = lora_unet(dataclasses.replace(CFG, remat=True, scan_layers=scan_layers))
        loss, grads, placed = loss_and_grads(remat_graphdef, (2, 2, 2), state, batch)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=f"scan_layers={scan_layers}")
        chex.assert_trees_all_close(grads, ref_grads, atol=1e-5, rtol=1e-4)
    kernel = placed["down_blocks"][0]["resnets"][0]["conv1"]["kernel"].get_value()
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, None, "fsdp", "tensor")
    lora_b = grads["down_blocks"][0]["resnets"][0]["conv1"]["lora"]["lora_b"].get_value()
    assert np.abs(lora_b).max() > 0
