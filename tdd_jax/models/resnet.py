"""ResNet block and 2x down/up-sampling used by the UNet and the VAE (Ho et al. 2020, App. B)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tdd_jax.models.layers import Conv, GroupNorm, Linear


class ResnetBlock2D(nnx.Module):
    """``x + conv2(silu(norm2(conv1(silu(norm1(x))) + proj(silu(temb)))))``, 1x1 shortcut if channels change."""

    def __init__(self, cin: int, cout: int, *, temb_dim: int | None, groups: int, eps: float,
                 dtype=jnp.float32, rngs: nnx.Rngs | None):
        self.norm1 = GroupNorm(groups, cin, eps, rngs=rngs)
        self.conv1 = Conv(cin, cout, 3, padding=1, dtype=dtype, rngs=rngs)
        self.time_emb_proj = (Linear(temb_dim, cout, axes=("embed", "conv_out"), dtype=dtype, rngs=rngs)
                              if temb_dim else nnx.data(None))
        self.norm2 = GroupNorm(groups, cout, eps, rngs=rngs)
        self.conv2 = Conv(cout, cout, 3, padding=1, dtype=dtype, rngs=rngs)
        self.conv_shortcut = Conv(cin, cout, 1, dtype=dtype, rngs=rngs) if cin != cout else nnx.data(None)

    def __call__(self, x: jax.Array, temb: jax.Array | None = None, lora_scale: float = 1.0) -> jax.Array:
        h = self.conv1(jax.nn.silu(self.norm1(x)), lora_scale)
        if self.time_emb_proj is not None:
            h = h + self.time_emb_proj(jax.nn.silu(temb), lora_scale)[:, None, None, :]
        h = self.conv2(jax.nn.silu(self.norm2(h)), lora_scale)
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x, lora_scale)
        return x.astype(h.dtype) + h


class Downsample2D(nnx.Module):
    """3x3 stride-2 conv; ``padding=0`` pads only bottom/right by one, as diffusers' VAE does."""

    def __init__(self, channels: int, *, padding: int = 1, dtype=jnp.float32, rngs: nnx.Rngs | None):
        pad = ((0, 1), (0, 1)) if padding == 0 else padding
        self.conv = Conv(channels, channels, 3, stride=2, padding=pad, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, lora_scale: float = 1.0) -> jax.Array:
        return self.conv(x, lora_scale)


class Upsample2D(nnx.Module):
    """Nearest-neighbour 2x upsampling followed by a 3x3 conv."""

    def __init__(self, channels: int, *, dtype=jnp.float32, rngs: nnx.Rngs | None):
        self.conv = Conv(channels, channels, 3, padding=1, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, lora_scale: float = 1.0) -> jax.Array:
        x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
        return self.conv(x, lora_scale)
