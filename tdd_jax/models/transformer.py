"""Spatial transformer of the latent-diffusion UNet (Rombach et al. 2022, Sec. 3.3 and App. E).

GroupNorm -> proj_in (1x1 conv or linear) -> N x [self-attn, cross-attn, GEGLU MLP] -> proj_out,
plus the input as a residual. With ``scan`` the N blocks run as one ``lax.scan`` over their stacked
weights (MaxText's ``scan_layers``): the compiled program holds one block whatever N (SDXL's distillation
step compiles on a 24 GB host only so).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tdd_jax.models.attention import Attention
from tdd_jax.models.layers import Conv, GroupNorm, LayerNorm, Linear


class FeedForward(nnx.Module):
    """GEGLU MLP: ``out(a * gelu(g))`` with ``[a, g] = geglu(x)`` (Shazeer 2020, eq. 6), hidden 4 x dim."""

    def __init__(self, dim: int, *, dtype=jnp.float32, rngs: nnx.Rngs | None):
        self.geglu = Linear(dim, 8 * dim, axes=("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.out = Linear(4 * dim, dim, axes=("mlp", "embed"), dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, lora_scale: float = 1.0) -> jax.Array:
        a, gate = jnp.split(self.geglu(x, lora_scale), 2, axis=-1)
        return self.out(a * jax.nn.gelu(gate, approximate=False), lora_scale)


class BasicTransformerBlock(nnx.Module):
    """Pre-LN block: ``x += attn1(norm1 x); x += attn2(norm2 x, context); x += ff(norm3 x)``."""

    def __init__(self, dim: int, num_heads: int, context_dim: int, *, unroll: bool = False, dtype=jnp.float32,
                 rngs: nnx.Rngs | None):
        head_dim = dim // num_heads
        self.norm1 = LayerNorm(dim, 1e-5, rngs=rngs)
        self.attn1 = Attention(dim, num_heads, head_dim, unroll=unroll, dtype=dtype, rngs=rngs)
        self.norm2 = LayerNorm(dim, 1e-5, rngs=rngs)
        self.attn2 = Attention(dim, num_heads, head_dim, context_dim=context_dim, unroll=unroll, dtype=dtype,
                               rngs=rngs)
        self.norm3 = LayerNorm(dim, 1e-5, rngs=rngs)
        self.ff = FeedForward(dim, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, context: jax.Array, lora_scale: float = 1.0) -> jax.Array:
        x = x + self.attn1(self.norm1(x), lora_scale=lora_scale)
        x = x + self.attn2(self.norm2(x), context, lora_scale)
        return x + self.ff(self.norm3(x), lora_scale)


def scan_blocks(blocks: nnx.List, tokens: jax.Array, context: jax.Array, lora_scale: float,
                remat: bool) -> jax.Array:
    """``blocks`` applied in turn as one ``lax.scan`` over their weights stacked along a new leading axis;
    with ``remat`` each block keeps only its input for the backward pass."""
    graphdef = nnx.graphdef(blocks[0])
    stacked = jax.tree.map(lambda *weights: jnp.stack(weights), *[nnx.state(block) for block in blocks])

    def body(x, state):
        return nnx.merge(graphdef, state)(x, context, lora_scale), None

    return jax.lax.scan(jax.checkpoint(body) if remat else body, tokens, stacked)[0]


class Transformer2D(nnx.Module):
    """Diffusers' ``Transformer2DModel`` for continuous NHWC inputs; ``scan`` / ``remat`` as ``scan_blocks``,
    ``unroll`` as ``multi_head_attention``'s."""

    def __init__(self, channels: int, num_heads: int, depth: int, context_dim: int, *, groups: int,
                 linear_projection: bool, scan: bool = False, remat: bool = False, unroll: bool = False,
                 dtype=jnp.float32, rngs: nnx.Rngs | None):
        if channels % num_heads:
            raise ValueError(f"{channels} channels are not divisible by {num_heads} attention heads")
        self.norm = GroupNorm(groups, channels, 1e-6, rngs=rngs)
        if linear_projection:
            self.proj_in = Linear(channels, channels, axes=("conv_in", "embed"), dtype=dtype, rngs=rngs)
            self.proj_out = Linear(channels, channels, axes=("embed", "conv_out"), dtype=dtype, rngs=rngs)
        else:
            self.proj_in = Conv(channels, channels, 1, dtype=dtype, rngs=rngs)
            self.proj_out = Conv(channels, channels, 1, dtype=dtype, rngs=rngs)
        self.transformer_blocks = nnx.List(
            [BasicTransformerBlock(channels, num_heads, context_dim, unroll=unroll, dtype=dtype, rngs=rngs)
             for _ in range(depth)])
        self.scan, self.remat = scan and depth > 1, remat

    def __call__(self, x: jax.Array, context: jax.Array, lora_scale: float = 1.0) -> jax.Array:
        b, h, w, c = x.shape
        # A 1x1 conv and a linear layer are the same map on NHWC, so proj_in/out are applied alike.
        tokens = self.proj_in(self.norm(x), lora_scale).reshape(b, h * w, c)
        if self.scan:
            tokens = scan_blocks(self.transformer_blocks, tokens, context, lora_scale, self.remat)
        else:
            for block in self.transformer_blocks:
                tokens = block(tokens, context, lora_scale)
        return x.astype(tokens.dtype) + self.proj_out(tokens.reshape(b, h, w, c), lora_scale)
