"""UNet2DConditionModel of Stable Diffusion 1.5 / SDXL in Flax NNX, built from a diffusers config.

Call: ``unet(sample, timesteps, encoder_hidden_states, added_cond_kwargs=None, *, lora_scale=1.0)``

- ``sample``: NHWC latents (B, H, W, C); ``timesteps``: (B,) or scalar;
- ``encoder_hidden_states``: (B, L, cross_attention_dim);
- ``added_cond_kwargs``: for SDXL (``addition_embed_type="text_time"``) a mapping with ``text_embeds`` (B, P) and
  ``time_ids`` (B, 6) = [orig_h, orig_w, crop_top, crop_left, target_h, target_w], as in diffusers;
- ``lora_scale``: a Python float multiplying every LoRA delta; 0.0 skips LoRA entirely (the base model
  exactly, e.g. for the frozen teacher pass).

Returns the NHWC noise prediction in ``sample``'s dtype.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from tdd_jax.models.layers import Conv, GroupNorm, Linear
from tdd_jax.models.resnet import Downsample2D, ResnetBlock2D, Upsample2D
from tdd_jax.models.transformer import Transformer2D

# diffusers config fields whose non-default values this implementation does not support.
_FIXED_FIELDS: dict[str, Any] = {
    "center_input_sample": False, "time_embedding_type": "positional", "class_embed_type": None,
    "encoder_hid_dim": None, "time_cond_proj_dim": None, "resnet_time_scale_shift": "default",
    "conv_in_kernel": 3, "conv_out_kernel": 3, "act_fn": "silu", "attention_type": "default",
    "only_cross_attention": False, "dual_cross_attention": False, "timestep_post_act": None,
    "time_embedding_act_fn": None, "time_embedding_dim": None, "mid_block_scale_factor": 1,
    "resnet_skip_time_act": False, "resnet_out_scale_factor": 1.0, "cross_attention_norm": None,
    "class_embeddings_concat": False, "reverse_transformer_layers_per_block": None,
    "mid_block_only_cross_attention": None, "num_class_embeds": None,
}
_DOWN_TYPES = ("DownBlock2D", "CrossAttnDownBlock2D")
_UP_TYPES = ("UpBlock2D", "CrossAttnUpBlock2D")


@dataclasses.dataclass(frozen=True)
class UNetConfig:
    """The subset of diffusers' UNet2DConditionModel config that SD1.5/SDXL use; per-block tuples.

    ``remat`` recomputes each block's activations in the backward pass; ``scan_layers`` runs each repeated
    stack of transformer blocks as one ``lax.scan`` (``tdd_jax.models.transformer.scan_blocks``; with
    ``remat``, per block); ``unroll_attention`` unrolls the TPU's loop over attention chunks (``launch.compile``'s
    cost copies: XLA's cost analysis counts a loop body once). None changes the parameters or the outputs.
    """

    in_channels: int = 4
    out_channels: int = 4
    down_block_types: tuple[str, ...] = ("CrossAttnDownBlock2D", "DownBlock2D")
    up_block_types: tuple[str, ...] = ("UpBlock2D", "CrossAttnUpBlock2D")
    block_out_channels: tuple[int, ...] = (32, 64)
    layers_per_block: tuple[int, ...] = (1, 1)
    transformer_layers_per_block: tuple[int, ...] = (1, 1)
    num_attention_heads: tuple[int, ...] = (2, 2)
    cross_attention_dim: tuple[int, ...] = (32, 32)
    use_linear_projection: bool = False
    mid_block: bool = True
    flip_sin_to_cos: bool = True
    freq_shift: float = 0.0
    norm_num_groups: int = 8
    norm_eps: float = 1e-5
    downsample_padding: int = 1
    addition_embed_type: str | None = None
    addition_time_embed_dim: int | None = None
    projection_class_embeddings_input_dim: int | None = None
    dtype: str = "float32"
    remat: bool = False
    scan_layers: bool = False
    unroll_attention: bool = False

    def __post_init__(self):
        n = len(self.block_out_channels)
        for name in ("down_block_types", "up_block_types", "layers_per_block", "transformer_layers_per_block",
                     "num_attention_heads", "cross_attention_dim"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"unet config {name} has {len(getattr(self, name))} entries, "
                                 f"block_out_channels has {n}")
        for name, allowed in (("down_block_types", _DOWN_TYPES), ("up_block_types", _UP_TYPES)):
            bad = [t for t in getattr(self, name) if t not in allowed]
            if bad:
                raise ValueError(f"unet config {name} contains unsupported {bad}; supported: {allowed}")
        if self.addition_embed_type not in (None, "text_time"):
            raise ValueError(f"unet config addition_embed_type={self.addition_embed_type!r} is not supported "
                             "(None or 'text_time')")
        if self.addition_embed_type and not (self.addition_time_embed_dim and self.projection_class_embeddings_input_dim):
            raise ValueError("unet config addition_embed_type='text_time' needs addition_time_embed_dim and "
                             "projection_class_embeddings_input_dim")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"unet config dtype={self.dtype!r} must be float32, bfloat16 or float16")

    @classmethod
    def from_diffusers(cls, config: Mapping[str, Any], **overrides) -> "UNetConfig":
        """Reads a diffusers ``unet/config.json`` dict; raises on fields this model does not implement."""
        for key, default in _FIXED_FIELDS.items():
            if key in config and config[key] != default:
                raise ValueError(f"unet config {key}={config[key]!r} is not supported (only {default!r})")
        if config.get("mid_block_type", "UNetMidBlock2DCrossAttn") not in ("UNetMidBlock2DCrossAttn", None):
            raise ValueError(f"unet config mid_block_type={config['mid_block_type']!r} is not supported")
        n = len(config["block_out_channels"])

        def per_block(key, default=None):
            value = config.get(key, default)
            if isinstance(value, (list, tuple)):
                if any(isinstance(v, (list, tuple)) for v in value):
                    raise ValueError(f"unet config {key}: nested per-layer lists are not supported")
                return tuple(value)
            return (value,) * n

        # diffusers' historical naming: attention_head_dim holds the number of heads unless num_attention_heads is set.
        heads = config.get("num_attention_heads") or config.get("attention_head_dim", 8)
        return cls(
            in_channels=config.get("in_channels", 4), out_channels=config.get("out_channels", 4),
            down_block_types=tuple(config["down_block_types"]), up_block_types=tuple(config["up_block_types"]),
            block_out_channels=tuple(config["block_out_channels"]),
            layers_per_block=per_block("layers_per_block", 2),
            transformer_layers_per_block=per_block("transformer_layers_per_block", 1),
            num_attention_heads=tuple(heads) if isinstance(heads, (list, tuple)) else (heads,) * n,
            cross_attention_dim=per_block("cross_attention_dim", 1280),
            use_linear_projection=bool(config.get("use_linear_projection", False)),
            mid_block=config.get("mid_block_type", "UNetMidBlock2DCrossAttn") is not None,
            flip_sin_to_cos=config.get("flip_sin_to_cos", True), freq_shift=config.get("freq_shift", 0),
            norm_num_groups=config.get("norm_num_groups", 32), norm_eps=config.get("norm_eps", 1e-5),
            downsample_padding=config.get("downsample_padding", 1),
            addition_embed_type=config.get("addition_embed_type"),
            addition_time_embed_dim=config.get("addition_time_embed_dim"),
            projection_class_embeddings_input_dim=config.get("projection_class_embeddings_input_dim"),
            **overrides)


def timestep_embedding(timesteps: jax.Array, dim: int, flip_sin_to_cos: bool, freq_shift: float,
                       max_period: float = 10000.0) -> jax.Array:
    """Sinusoidal embedding (Vaswani et al. 2017, Sec. 3.5): ``[sin(t w_i), cos(t w_i)]``,
    ``w_i = max_period^(-i / (dim/2 - freq_shift))``; cos first if ``flip_sin_to_cos``."""
    half = dim // 2
    freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / (half - freq_shift))
    args = timesteps.astype(jnp.float32)[:, None] * freqs[None]
    parts = (jnp.cos(args), jnp.sin(args)) if flip_sin_to_cos else (jnp.sin(args), jnp.cos(args))
    emb = jnp.concatenate(parts, axis=-1)
    return jnp.pad(emb, ((0, 0), (0, dim % 2)))


class TimestepEmbedding(nnx.Module):
    """``linear_2(silu(linear_1(x)))``."""

    def __init__(self, din: int, dout: int, *, dtype, rngs: nnx.Rngs | None):
        self.linear_1 = Linear(din, dout, axes=("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.linear_2 = Linear(dout, dout, axes=("mlp", "embed"), dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, lora_scale: float = 1.0) -> jax.Array:
        return self.linear_2(jax.nn.silu(self.linear_1(x, lora_scale)), lora_scale)


class UNetBlock(nnx.Module):
    """A down, mid or up block: resnets, optional transformers after each resnet, optional resampler.

    Down blocks return every intermediate output as skip connections; up blocks concatenate one skip
    per resnet along channels. The mid block is resnet, then (transformer, resnet) pairs.
    """

    def __init__(self, cfg: UNetConfig, kind: str, resnet_channels: list[tuple[int, int]], attention: bool,
                 block: int, resample: bool, temb_dim: int, dtype, rngs: nnx.Rngs | None):
        self.kind = kind
        self.resnets = nnx.List([
            ResnetBlock2D(cin, cout, temb_dim=temb_dim, groups=cfg.norm_num_groups, eps=cfg.norm_eps,
                          dtype=dtype, rngs=rngs) for cin, cout in resnet_channels])
        cout = resnet_channels[-1][1]
        n_attn = len(resnet_channels) - (kind == "mid")
        self.attentions = nnx.List([
            Transformer2D(cout, cfg.num_attention_heads[block], cfg.transformer_layers_per_block[block],
                          cfg.cross_attention_dim[block], groups=cfg.norm_num_groups,
                          linear_projection=cfg.use_linear_projection, scan=cfg.scan_layers, remat=cfg.remat,
                          unroll=cfg.unroll_attention, dtype=dtype, rngs=rngs)
            for _ in range(n_attn)] if attention else [])
        self.downsampler = (Downsample2D(cout, padding=cfg.downsample_padding, dtype=dtype, rngs=rngs)
                            if resample and kind == "down" else nnx.data(None))
        self.upsampler = Upsample2D(cout, dtype=dtype, rngs=rngs) if resample and kind == "up" else nnx.data(None)

    def __call__(self, h, temb, context, skips, lora_scale):
        if self.kind == "mid":
            h = self.resnets[0](h, temb, lora_scale)
            for attention, resnet in zip(self.attentions, self.resnets[1:]):
                h = resnet(attention(h, context, lora_scale), temb, lora_scale)
            return h, []
        outputs = []
        for i, resnet in enumerate(self.resnets):
            if self.kind == "up":
                h = jnp.concatenate([h, skips[-1 - i].astype(h.dtype)], axis=-1)
            h = resnet(h, temb, lora_scale)
            if self.attentions:
                h = self.attentions[i](h, context, lora_scale)
            outputs.append(h)
        if self.downsampler is not None:
            h = self.downsampler(h, lora_scale)
            outputs.append(h)
        if self.upsampler is not None:
            h = self.upsampler(h, lora_scale)
        return h, outputs


class UNet2DConditionModel(nnx.Module):
    """Conditional UNet of latent diffusion (Rombach et al. 2022); SDXL added conditioning (Podell et al. 2023)."""

    def __init__(self, cfg: UNetConfig, *, rngs: nnx.Rngs | None):
        self.cfg = cfg
        dtype = jnp.dtype(cfg.dtype)
        ch = cfg.block_out_channels
        temb_dim = 4 * ch[0]
        self.conv_in = Conv(cfg.in_channels, ch[0], 3, padding=1, dtype=dtype, rngs=rngs)
        self.time_embedding = TimestepEmbedding(ch[0], temb_dim, dtype=dtype, rngs=rngs)
        self.add_embedding = (TimestepEmbedding(cfg.projection_class_embeddings_input_dim, temb_dim, dtype=dtype,
                                                rngs=rngs) if cfg.addition_embed_type else nnx.data(None))
        n = len(ch)
        down = []
        for i, kind in enumerate(cfg.down_block_types):
            cin = ch[max(i - 1, 0)]
            channels = [(cin if j == 0 else ch[i], ch[i]) for j in range(cfg.layers_per_block[i])]
            down.append(UNetBlock(cfg, "down", channels, kind.startswith("CrossAttn"), i, i < n - 1, temb_dim,
                                  dtype, rngs))
        self.down_blocks = nnx.List(down)
        self.mid_block = (UNetBlock(cfg, "mid", [(ch[-1], ch[-1])] * 2, True, n - 1, False, temb_dim, dtype, rngs)
                          if cfg.mid_block else nnx.data(None))
        up = []
        rch = ch[::-1]
        for i, kind in enumerate(cfg.up_block_types):
            prev, cout, skip_in = rch[max(i - 1, 0)], rch[i], rch[min(i + 1, n - 1)]
            layers = cfg.layers_per_block[n - 1 - i] + 1
            channels = [((prev if j == 0 else cout) + (skip_in if j == layers - 1 else cout), cout)
                        for j in range(layers)]
            up.append(UNetBlock(cfg, "up", channels, kind.startswith("CrossAttn"), n - 1 - i, i < n - 1, temb_dim,
                                dtype, rngs))
        self.up_blocks = nnx.List(up)
        self.conv_norm_out = GroupNorm(cfg.norm_num_groups, ch[0], cfg.norm_eps, rngs=rngs)
        self.conv_out = Conv(ch[0], cfg.out_channels, 3, padding=1, dtype=dtype, rngs=rngs)

    def time_conditioning(self, timesteps, batch: int, added_cond_kwargs, lora_scale: float) -> jax.Array:
        """Timestep embedding plus, for SDXL, ``add_embedding([text_embeds, emb(time_ids)])``."""
        cfg = self.cfg
        t = jnp.broadcast_to(jnp.asarray(timesteps), (batch,))
        temb = self.time_embedding(
            timestep_embedding(t, cfg.block_out_channels[0], cfg.flip_sin_to_cos, cfg.freq_shift), lora_scale)
        if cfg.addition_embed_type == "text_time":
            if added_cond_kwargs is None or "text_embeds" not in added_cond_kwargs or "time_ids" not in added_cond_kwargs:
                raise ValueError("this UNet has addition_embed_type='text_time': pass added_cond_kwargs with "
                                 "'text_embeds' and 'time_ids'")
            time_ids = jnp.asarray(added_cond_kwargs["time_ids"])
            time_embeds = timestep_embedding(time_ids.reshape(-1), cfg.addition_time_embed_dim, cfg.flip_sin_to_cos,
                                             cfg.freq_shift).reshape(batch, -1)
            add = jnp.concatenate([jnp.asarray(added_cond_kwargs["text_embeds"], jnp.float32), time_embeds], axis=-1)
            temb = temb + self.add_embedding(add, lora_scale)
        return temb

    def __call__(self, sample: jax.Array, timesteps: jax.Array, encoder_hidden_states: jax.Array,
                 added_cond_kwargs: Mapping[str, jax.Array] | None = None, *, lora_scale: float = 1.0) -> jax.Array:
        h = self.block_outputs(sample, timesteps, encoder_hidden_states, added_cond_kwargs, lora_scale=lora_scale)[-1]
        return self.conv_out(jax.nn.silu(self.conv_norm_out(h)), lora_scale).astype(sample.dtype)

    def block_outputs(self, sample: jax.Array, timesteps: jax.Array, encoder_hidden_states: jax.Array,
                      added_cond_kwargs: Mapping[str, jax.Array] | None = None, *,
                      lora_scale: float = 1.0) -> list[jax.Array]:
        """The output of every down block, of the mid block and of every up block, in that order."""
        cfg = self.cfg
        factor = 2 ** (len(cfg.block_out_channels) - 1)
        if sample.ndim != 4 or sample.shape[1] % factor or sample.shape[2] % factor:
            raise ValueError(f"sample must be NHWC with H and W divisible by {factor}, got {sample.shape}")
        if sample.shape[-1] != cfg.in_channels:
            raise ValueError(f"sample has {sample.shape[-1]} channels (last axis, NHWC), "
                             f"the UNet expects in_channels={cfg.in_channels}")
        temb = self.time_conditioning(timesteps, sample.shape[0], added_cond_kwargs, lora_scale)

        def run(block, h, skips):
            return block(h, temb, encoder_hidden_states, skips, lora_scale)

        run = nnx.remat(run) if cfg.remat else run
        h = self.conv_in(sample, lora_scale)
        skips, outputs = [h], []
        for block in self.down_blocks:
            h, block_skips = run(block, h, [])
            skips.extend(block_skips)
            outputs.append(h)
        if self.mid_block is not None:
            h, _ = run(self.mid_block, h, [])
            outputs.append(h)
        for block in self.up_blocks:
            n = len(block.resnets)
            h, _ = run(block, h, skips[-n:])
            skips = skips[:-n]
            outputs.append(h)
        return outputs
