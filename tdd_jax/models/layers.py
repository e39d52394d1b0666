"""Leaf layers with PyTorch numerics, a compute dtype, logical axes and an optional LoRA slot.

Parameters are stored in float32 and cast to the compute ``dtype`` at use; norms
always compute in float32. Built with ``rngs=None`` a layer is abstract (ShapeDtypeStruct
parameters): that is how checkpoints are loaded without tracing or allocating an initialisation. Activations are NHWC. ``Linear`` and ``Conv`` carry a
``lora`` attribute (``None`` until ``tdd_jax.models.lora.add_lora`` fills it) whose
output is added, times ``lora_scale``, to the base output (Hu et al. 2021, eq. 3).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from runtime.cpu_matmul import contract

Axes = tuple[str | None, ...]
_INIT = nnx.initializers.lecun_normal()


def _param(rngs: nnx.Rngs | None, shape: Sequence[int], axes: Axes, init=_INIT) -> nnx.Param:
    """A float32 parameter; ``rngs=None`` builds an abstract one (shape only, for loading)."""
    if rngs is None:
        return nnx.Param(jax.ShapeDtypeStruct(tuple(shape), jnp.float32), out_sharding=axes)
    return nnx.Param(init(rngs.params(), tuple(shape), jnp.float32), out_sharding=axes)


def conv2d(x: jax.Array, kernel: jax.Array, stride: int, padding: Sequence[tuple[int, int]]) -> jax.Array:
    """NHWC x HWIO convolution (PyTorch ``Conv2d`` cross-correlation)."""
    return jax.lax.conv_general_dilated(x, kernel, (stride, stride), tuple(padding),
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


class Linear(nnx.Module):
    """``y = x W + b`` with ``W`` of shape (in, out) (``torch.nn.Linear`` weight transposed)."""

    def __init__(self, din: int, dout: int, *, use_bias: bool = True, axes: Axes = ("embed", "mlp"),
                 dtype=jnp.float32, rngs: nnx.Rngs | None):
        self.kernel = _param(rngs, (din, dout), axes)
        self.bias = _param(rngs, (dout,), axes[1:], nnx.initializers.zeros_init()) if use_bias else nnx.data(None)
        self.dtype = dtype
        self.lora = nnx.data(None)

    def __call__(self, x: jax.Array, lora_scale: float = 1.0) -> jax.Array:
        x = x.astype(self.dtype)
        y = contract(x, self.kernel.get_value().astype(self.dtype))
        if self.bias is not None:
            y = y + self.bias.get_value().astype(self.dtype)
        if self.lora is not None and lora_scale:
            y = y + lora_scale * self.lora(x)
        return y


class Conv(nnx.Module):
    """2-D convolution, kernel (kh, kw, in, out); ``padding`` is symmetric or ((top, bottom), (left, right))."""

    def __init__(self, cin: int, cout: int, kernel_size: int, *, stride: int = 1,
                 padding: int | Sequence[tuple[int, int]] = 0, dtype=jnp.float32, rngs: nnx.Rngs | None):
        self.kernel = _param(rngs, (kernel_size, kernel_size, cin, cout), ("conv_kernel", "conv_kernel", "conv_in", "conv_out"))
        self.bias = _param(rngs, (cout,), ("conv_out",), nnx.initializers.zeros_init())
        self.stride = stride
        self.padding = ((padding, padding),) * 2 if isinstance(padding, int) else tuple(map(tuple, padding))
        self.dtype = dtype
        self.lora = nnx.data(None)

    def __call__(self, x: jax.Array, lora_scale: float = 1.0) -> jax.Array:
        x = x.astype(self.dtype)
        y = conv2d(x, self.kernel.get_value().astype(self.dtype), self.stride, self.padding)
        y = y + self.bias.get_value().astype(self.dtype)
        if self.lora is not None and lora_scale:
            y = y + lora_scale * self.lora(x)
        return y


class GroupNorm(nnx.Module):
    """Group normalisation (Wu & He 2018, eq. 1) over NHWC channels, biased variance, float32."""

    def __init__(self, num_groups: int, channels: int, eps: float, *, rngs: nnx.Rngs | None):
        if channels % num_groups:
            raise ValueError(f"GroupNorm: {channels} channels are not divisible by norm_num_groups={num_groups}")
        self.scale = _param(rngs, (channels,), ("norm",), nnx.initializers.ones_init())
        self.bias = _param(rngs, (channels,), ("norm",), nnx.initializers.zeros_init())
        self.num_groups = num_groups
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.lax.platform_dependent(x.astype(jnp.float32), cpu=self._normalise_by_channel_sums,
                                       default=self._normalise)
        return (h * self.scale.get_value() + self.bias.get_value()).astype(x.dtype)

    def _normalise(self, x: jax.Array) -> jax.Array:
        """``(x - mean) / sqrt(var + eps)`` over each sample's groups (spatial axes and the group's channels)."""
        h = x.reshape(x.shape[0], -1, self.num_groups, x.shape[-1] // self.num_groups)
        mean = h.mean(axis=(1, 3), keepdims=True)
        var = jnp.square(h - mean).mean(axis=(1, 3), keepdims=True)
        return ((h - mean) * jax.lax.rsqrt(var + self.eps)).reshape(x.shape)

    def _normalise_by_channel_sums(self, x: jax.Array) -> jax.Array:
        """``_normalise`` for XLA:CPU: sums over the spatial axes per channel, then over each group's channels.

        XLA:CPU reduces ``[B, H*W, C]`` over ``H*W`` several times faster than ``[B, H*W, G, C/G]`` over
        ``H*W`` and ``C/G`` at once; the statistics are the same sums in another order.
        """
        b, c = x.shape[0], x.shape[-1]
        h = x.reshape(b, -1, c)
        count = h.shape[1] * (c // self.num_groups)

        def group_mean(t):  # [B, N, C] -> each channel's group mean, [B, 1, C]
            sums = t.sum(1).reshape(b, self.num_groups, -1).sum(-1, keepdims=True)
            return jnp.broadcast_to(sums / count, (b, self.num_groups, c // self.num_groups)).reshape(b, 1, c)

        mean = group_mean(h)
        var = group_mean(jnp.square(h - mean))
        return ((h - mean) * jax.lax.rsqrt(var + self.eps)).reshape(x.shape)


class LayerNorm(nnx.Module):
    """Layer normalisation (Ba et al. 2016) over the last axis, float32."""

    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs | None):
        self.scale = _param(rngs, (dim,), ("norm",), nnx.initializers.ones_init())
        self.bias = _param(rngs, (dim,), ("norm",), nnx.initializers.zeros_init())
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        mean = h.mean(-1, keepdims=True)
        var = jnp.square(h - mean).mean(-1, keepdims=True)
        h = (h - mean) * jax.lax.rsqrt(var + self.eps)
        return (h * self.scale.get_value() + self.bias.get_value()).astype(x.dtype)


class Embed(nnx.Module):
    """Lookup table (num, dim)."""

    def __init__(self, num: int, dim: int, *, axes: Axes = ("vocab", "embed"), rngs: nnx.Rngs | None):
        self.embedding = _param(rngs, (num, dim), axes, nnx.initializers.normal(0.02))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding.get_value(), ids, axis=0)
