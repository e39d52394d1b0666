"""Our UNet equals diffusers' PyTorch UNet2DConditionModel on tiny SD1.5-like and SDXL-like configs."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from tdd_jax.models.diffusers_io import TensorFile, load_module
from tdd_jax.models.layers import GroupNorm
from tdd_jax.models.unet import UNet2DConditionModel, UNetConfig, timestep_embedding

SD15 = dict(
    sample_size=16, in_channels=4, out_channels=4, block_out_channels=(16, 32, 32), layers_per_block=1,
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=24, attention_head_dim=2, norm_num_groups=8)
SDXL = dict(
    sample_size=16, in_channels=4, out_channels=4, block_out_channels=(16, 24, 32), layers_per_block=(1, 2, 1),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    transformer_layers_per_block=(1, 1, 2), attention_head_dim=(2, 2, 4), cross_attention_dim=32,
    use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
    projection_class_embeddings_input_dim=16 + 6 * 8, norm_num_groups=8, flip_sin_to_cos=True, freq_shift=0)


def torch_unet(config, tmp_path_factory, name):
    from diffusers import UNet2DConditionModel as TorchUNet

    torch.manual_seed(0)
    model = TorchUNet(**config).eval()
    with torch.no_grad():  # random non-zero norms and biases so every parameter matters
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder)
    return model, folder


def inputs(config, batch=2, seed=0):
    rng = np.random.default_rng(seed)
    cross = config["cross_attention_dim"]
    x = rng.normal(size=(batch, config["in_channels"], 16, 16)).astype(np.float32)
    t = np.array([999, 17][:batch], np.int64)
    ctx = rng.normal(size=(batch, 7, cross)).astype(np.float32)
    added = None
    if config.get("addition_embed_type") == "text_time":
        added = {"text_embeds": rng.normal(size=(batch, 16)).astype(np.float32),
                 "time_ids": np.tile(np.array([[32, 24, 0, 4, 16, 16]], np.float32), (batch, 1))}
    return x, t, ctx, added


def run_torch(model, x, t, ctx, added):
    kwargs = {}
    if added is not None:
        kwargs["added_cond_kwargs"] = {k: torch.from_numpy(v) for k, v in added.items()}
    with torch.no_grad():
        return model(torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(ctx), **kwargs).sample.numpy()


def load_ours(folder, **overrides):
    with open(folder / "config.json") as f:
        cfg = UNetConfig.from_diffusers(json.load(f), **overrides)
    tensors = TensorFile.open([str(folder / "diffusion_pytorch_model.safetensors")])
    return load_module(lambda rngs: UNet2DConditionModel(cfg, rngs=rngs), tensors)


def run_ours(unet, x, t, ctx, added):
    out = jax.jit(lambda m, *a: m(*a))(unet, jnp.asarray(x.transpose(0, 2, 3, 1)), t, ctx, added)
    return np.asarray(out).transpose(0, 3, 1, 2)


@pytest.mark.parametrize("name,config", [("sd15", SD15), ("sdxl", SDXL)])
def test_unet_matches_diffusers(name, config, tmp_path_factory):
    model, folder = torch_unet(config, tmp_path_factory, name)
    args = inputs(config)
    expected = run_torch(model, *args)
    got = run_ours(load_ours(folder), *args)
    assert np.abs(expected).max() > 0.1
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def test_timestep_embedding_hand_values():
    # dim 4, shift 0: w = [1, 10000^(-1/2)] = [1, 0.01]; t = 2.
    got = np.asarray(timestep_embedding(jnp.array([2.0]), 4, flip_sin_to_cos=False, freq_shift=0.0))
    np.testing.assert_allclose(got[0], [math.sin(2), math.sin(0.02), math.cos(2), math.cos(0.02)], rtol=1e-6)
    flipped = np.asarray(timestep_embedding(jnp.array([2.0]), 5, flip_sin_to_cos=True, freq_shift=1.0))
    # shift 1: w = [1, 10000^(-1/1)]; odd dim pads one zero.
    np.testing.assert_allclose(flipped[0], [math.cos(2), math.cos(2e-4), math.sin(2), math.sin(2e-4), 0.0],
                               rtol=1e-6, atol=1e-7)


def test_unsupported_config_field_is_named():
    with pytest.raises(ValueError, match="class_embed_type"):
        UNetConfig.from_diffusers({**SD15, "class_embed_type": "timestep"})
    with pytest.raises(ValueError, match="down_block_types"):
        UNetConfig.from_diffusers({**SD15, "down_block_types": ("SimpleCrossAttnDownBlock2D",) * 3})


def test_bfloat16_compute_stays_close_to_float32():
    small = dict(down_block_types=("CrossAttnDownBlock2D",), up_block_types=("CrossAttnUpBlock2D",),
                 block_out_channels=(16,), layers_per_block=(1,), transformer_layers_per_block=(1,),
                 num_attention_heads=(2,), cross_attention_dim=(8,), norm_num_groups=4)
    rng = np.random.default_rng(0)
    x, ctx = rng.normal(size=(1, 8, 8, 4)).astype(np.float32), rng.normal(size=(1, 3, 8)).astype(np.float32)
    outputs = {}
    for dtype in ("float32", "bfloat16"):
        with nnx.use_eager_sharding(False):
            graphdef, abstract = nnx.split(UNet2DConditionModel(UNetConfig(**small, dtype=dtype), rngs=None))
        state = jax.tree.map(lambda s: (0.2 * np.random.default_rng(1).normal(size=s.shape)).astype(np.float32),
                             abstract)
        out = jax.jit(lambda s, *a: nnx.merge(graphdef, s)(*a))(state, x, np.array([300]), ctx)
        assert out.dtype == jnp.float32  # returned in the sample's dtype
        outputs[dtype] = np.asarray(out)
    scale = np.abs(outputs["float32"]).max()
    error = np.abs(outputs["bfloat16"] - outputs["float32"]).max()
    assert scale > 0.1 and 0 < error < 0.05 * scale


def test_group_norm_both_lowerings_match_numpy():
    """The CPU's channel-sum statistics and the other platforms' grouped ones: both equal eq. 1 in NumPy."""
    with nnx.use_eager_sharding(False):
        norm = GroupNorm(4, 8, 1e-5, rngs=nnx.Rngs(0))
    x = np.random.default_rng(0).normal(3.0, 2.0, size=(2, 5, 3, 8)).astype(np.float32)
    groups = x.astype(np.float64).reshape(2, -1, 4, 2)
    want = ((groups - groups.mean((1, 3), keepdims=True)) / np.sqrt(groups.var((1, 3), keepdims=True) + 1e-5))
    for normalise in (norm._normalise, norm._normalise_by_channel_sums):
        np.testing.assert_allclose(jax.jit(normalise)(x), want.reshape(x.shape), rtol=1e-5, atol=1e-5)
