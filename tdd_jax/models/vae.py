"""AutoencoderKL of latent diffusion (Rombach et al. 2022, Sec. 3.1) in Flax NNX, NHWC.

``vae.encode(images)`` returns the diagonal Gaussian posterior q(z|x) (``mean``, ``logvar``);
``vae.decode(z)`` maps latents back to images in [-1, 1]. The diffusion model sees
``scale_latents(z) = (z - shift_factor) * scaling_factor`` (0.18215 for SD1.5, 0.13025 for SDXL).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tdd_jax.models.attention import multi_head_attention
from tdd_jax.models.layers import Conv, GroupNorm, Linear
from tdd_jax.models.resnet import Downsample2D, ResnetBlock2D, Upsample2D

_FIXED_FIELDS: dict[str, Any] = {"act_fn": "silu", "norm_type": "group", "use_quant_conv": True,
                                 "use_post_quant_conv": True, "mid_block_add_attention": True}


@dataclasses.dataclass(frozen=True)
class VAEConfig:
    """diffusers ``AutoencoderKL`` config fields used by SD1.5 / SDXL."""

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 4
    block_out_channels: tuple[int, ...] = (32, 64)
    layers_per_block: int = 1
    norm_num_groups: int = 8
    scaling_factor: float = 0.18215
    shift_factor: float = 0.0
    dtype: str = "float32"

    @classmethod
    def from_diffusers(cls, config: Mapping[str, Any], **overrides) -> "VAEConfig":
        """Reads a diffusers ``vae/config.json`` dict; raises on fields this model does not implement."""
        for key, default in _FIXED_FIELDS.items():
            if key in config and config[key] != default:
                raise ValueError(f"vae config {key}={config[key]!r} is not supported (only {default!r})")
        for key, kind in (("down_block_types", "DownEncoderBlock2D"), ("up_block_types", "UpDecoderBlock2D")):
            if any(t != kind for t in config.get(key, ())):
                raise ValueError(f"vae config {key}={config[key]!r}: only {kind} is supported")
        return cls(in_channels=config.get("in_channels", 3), out_channels=config.get("out_channels", 3),
                   latent_channels=config.get("latent_channels", 4),
                   block_out_channels=tuple(config.get("block_out_channels", (64,))),
                   layers_per_block=config.get("layers_per_block", 1),
                   norm_num_groups=config.get("norm_num_groups", 32),
                   scaling_factor=config.get("scaling_factor", 0.18215),
                   shift_factor=config.get("shift_factor") or 0.0, **overrides)


class DiagonalGaussian(NamedTuple):
    """q(z|x) = N(mean, exp(logvar)); logvar clipped to [-30, 20] as in diffusers."""

    mean: jax.Array
    logvar: jax.Array

    def sample(self, key: jax.Array) -> jax.Array:
        """Reparameterised draw ``mean + exp(logvar / 2) * eps`` (Kingma & Welling 2014, eq. 10)."""
        eps = jax.random.normal(key, self.mean.shape, jnp.float32)
        return self.mean + jnp.exp(0.5 * self.logvar) * eps


class VAEAttention(nnx.Module):
    """Single-head spatial self-attention with group norm and a residual (the VAE mid block)."""

    def __init__(self, channels: int, groups: int, *, dtype, rngs: nnx.Rngs | None):
        self.group_norm = GroupNorm(groups, channels, 1e-6, rngs=rngs)
        self.to_q = Linear(channels, channels, axes=("embed", "heads"), dtype=dtype, rngs=rngs)
        self.to_k = Linear(channels, channels, axes=("embed", "heads"), dtype=dtype, rngs=rngs)
        self.to_v = Linear(channels, channels, axes=("embed", "heads"), dtype=dtype, rngs=rngs)
        self.to_out = Linear(channels, channels, axes=("heads", "embed"), dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, h, w, c = x.shape
        tokens = self.group_norm(x).reshape(b, h * w, c)
        out = multi_head_attention(self.to_q(tokens), self.to_k(tokens), self.to_v(tokens), 1)
        return x + self.to_out(out).reshape(b, h, w, c)


class MidBlock(nnx.Module):
    """resnet -> attention -> resnet, without time embedding."""

    def __init__(self, channels: int, groups: int, *, dtype, rngs: nnx.Rngs | None):
        self.resnets = nnx.List([ResnetBlock2D(channels, channels, temb_dim=None, groups=groups, eps=1e-6,
                                               dtype=dtype, rngs=rngs) for _ in range(2)])
        self.attentions = nnx.List([VAEAttention(channels, groups, dtype=dtype, rngs=rngs)])

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.resnets[1](self.attentions[0](self.resnets[0](x)))


class CoderBlock(nnx.Module):
    """Resnets followed by an optional 2x down- or upsampler."""

    def __init__(self, cin: int, cout: int, layers: int, groups: int, resample: str | None, *, dtype,
                 rngs: nnx.Rngs | None):
        self.resnets = nnx.List([ResnetBlock2D(cin if i == 0 else cout, cout, temb_dim=None, groups=groups, eps=1e-6,
                                               dtype=dtype, rngs=rngs) for i in range(layers)])
        self.downsampler = (Downsample2D(cout, padding=0, dtype=dtype, rngs=rngs) if resample == "down"
                            else nnx.data(None))
        self.upsampler = Upsample2D(cout, dtype=dtype, rngs=rngs) if resample == "up" else nnx.data(None)

    def __call__(self, x: jax.Array) -> jax.Array:
        for resnet in self.resnets:
            x = resnet(x)
        if self.downsampler is not None:
            x = self.downsampler(x)
        if self.upsampler is not None:
            x = self.upsampler(x)
        return x


class Encoder(nnx.Module):
    def __init__(self, cfg: VAEConfig, *, dtype, rngs: nnx.Rngs | None):
        ch, groups, n = cfg.block_out_channels, cfg.norm_num_groups, len(cfg.block_out_channels)
        self.conv_in = Conv(cfg.in_channels, ch[0], 3, padding=1, dtype=dtype, rngs=rngs)
        self.down_blocks = nnx.List([
            CoderBlock(ch[max(i - 1, 0)], ch[i], cfg.layers_per_block, groups, "down" if i < n - 1 else None,
                       dtype=dtype, rngs=rngs) for i in range(n)])
        self.mid_block = MidBlock(ch[-1], groups, dtype=dtype, rngs=rngs)
        self.conv_norm_out = GroupNorm(groups, ch[-1], 1e-6, rngs=rngs)
        self.conv_out = Conv(ch[-1], 2 * cfg.latent_channels, 3, padding=1, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.conv_in(x)
        for block in self.down_blocks:
            h = block(h)
        return self.conv_out(jax.nn.silu(self.conv_norm_out(self.mid_block(h))))


class Decoder(nnx.Module):
    def __init__(self, cfg: VAEConfig, *, dtype, rngs: nnx.Rngs | None):
        rch, groups, n = cfg.block_out_channels[::-1], cfg.norm_num_groups, len(cfg.block_out_channels)
        self.conv_in = Conv(cfg.latent_channels, rch[0], 3, padding=1, dtype=dtype, rngs=rngs)
        self.mid_block = MidBlock(rch[0], groups, dtype=dtype, rngs=rngs)
        self.up_blocks = nnx.List([
            CoderBlock(rch[max(i - 1, 0)], rch[i], cfg.layers_per_block + 1, groups, "up" if i < n - 1 else None,
                       dtype=dtype, rngs=rngs) for i in range(n)])
        self.conv_norm_out = GroupNorm(groups, rch[-1], 1e-6, rngs=rngs)
        self.conv_out = Conv(rch[-1], cfg.out_channels, 3, padding=1, dtype=dtype, rngs=rngs)

    def __call__(self, z: jax.Array) -> jax.Array:
        h = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            h = block(h)
        return self.conv_out(jax.nn.silu(self.conv_norm_out(h)))


class AutoencoderKL(nnx.Module):
    """KL-regularised autoencoder: ``encode`` -> ``DiagonalGaussian``, ``decode`` -> images."""

    def __init__(self, cfg: VAEConfig, *, rngs: nnx.Rngs | None):
        self.cfg = cfg
        dtype = jnp.dtype(cfg.dtype)
        self.encoder = Encoder(cfg, dtype=dtype, rngs=rngs)
        self.decoder = Decoder(cfg, dtype=dtype, rngs=rngs)
        self.quant_conv = Conv(2 * cfg.latent_channels, 2 * cfg.latent_channels, 1, dtype=dtype, rngs=rngs)
        self.post_quant_conv = Conv(cfg.latent_channels, cfg.latent_channels, 1, dtype=dtype, rngs=rngs)

    def encode(self, images: jax.Array) -> DiagonalGaussian:
        """Posterior of NHWC ``images`` in [-1, 1]; float32."""
        moments = self.quant_conv(self.encoder(images)).astype(jnp.float32)
        mean, logvar = jnp.split(moments, 2, axis=-1)
        return DiagonalGaussian(mean, jnp.clip(logvar, -30.0, 20.0))

    def decode(self, latents: jax.Array) -> jax.Array:
        """NHWC images from unscaled latents; float32."""
        return self.decoder(self.post_quant_conv(latents)).astype(jnp.float32)

    def scale_latents(self, latents: jax.Array) -> jax.Array:
        """What the UNet sees: ``(z - shift_factor) * scaling_factor``."""
        return (latents - self.cfg.shift_factor) * self.cfg.scaling_factor

    def scale_posterior(self, posterior: DiagonalGaussian) -> DiagonalGaussian:
        """The posterior of the scaled latents: ``N((mean − shift)·f, f²·exp(logvar))``, f the scaling factor."""
        return DiagonalGaussian(self.scale_latents(posterior.mean),
                                posterior.logvar + 2.0 * float(np.log(self.cfg.scaling_factor)))

    def unscale_latents(self, latents: jax.Array) -> jax.Array:
        """Inverse of ``scale_latents``."""
        return latents / self.cfg.scaling_factor + self.cfg.shift_factor
