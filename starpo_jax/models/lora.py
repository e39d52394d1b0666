"""Dense projections with optional low-rank adapters (Hu et al. 2021, LoRA eq. 3).

``h = x W0 + (alpha / r) x A B`` with ``A`` random and ``B`` zero at initialisation.
Adapters are ``nnx.LoRAParam`` variables, so ``nnx.split(model, nnx.LoRAParam, ...)``
separates them from the frozen base weights.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from runtime import cpu_matmul

# Adapters train, so they stay float32 whatever the base weights' storage dtype (``param_dtype``).
ADAPTER_DTYPE = jnp.float32
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Adapter rank, scale numerator ``alpha`` and the projections that get adapters (PEFT names)."""

    rank: int = 64
    alpha: float = 64.0
    targets: tuple[str, ...] = ALL_LINEAR

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"LoRAConfig.rank must be a positive integer, got {self.rank!r}")
        unknown = sorted(set(self.targets) - set(ALL_LINEAR))
        if unknown:
            raise ValueError(f"LoRAConfig.targets has unknown module(s) {unknown}; known: {ALL_LINEAR}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class Dense(nnx.Module):
    """``y = x . W (+ b)`` over ``in_shape`` -> ``out_shape`` with logical axes, plus an optional adapter.

    Args:
      in_shape, out_shape: trailing input dims contracted, output dims produced.
      in_axes, out_axes: logical axis names of those dims.
      lora: adapter config, or ``None`` for a plain projection.
    """

    def __init__(self, in_shape: Sequence[int], out_shape: Sequence[int], in_axes: Sequence[str],
                 out_axes: Sequence[str], *, use_bias: bool = False, lora: LoRAConfig | None = None,
                 param_dtype: Any = jnp.float32, dtype: Any = jnp.float32, rngs: nnx.Rngs):
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        self.dtype = dtype
        fan_in = math.prod(self.in_shape)
        init = nnx.initializers.normal(1.0 / math.sqrt(fan_in))
        self.kernel = nnx.Param(nnx.with_partitioning(init, (*in_axes, *out_axes))(
            rngs.params(), self.in_shape + self.out_shape, param_dtype))
        self.bias = nnx.Param(nnx.with_partitioning(nnx.initializers.zeros_init(), tuple(out_axes))(
            rngs.params(), self.out_shape, param_dtype)) if use_bias else None
        self.lora_scale = lora.scale if lora is not None else 0.0
        if lora is not None:
            self.lora_a = nnx.LoRAParam(nnx.with_partitioning(init, (*in_axes, "lora_rank"))(
                rngs.params(), self.in_shape + (lora.rank,), ADAPTER_DTYPE))
            self.lora_b = nnx.LoRAParam(nnx.with_partitioning(nnx.initializers.zeros_init(), ("lora_rank", *out_axes))(
                rngs.params(), (lora.rank,) + self.out_shape, ADAPTER_DTYPE))
        else:
            self.lora_a = self.lora_b = None

    def __call__(self, x: jax.Array) -> jax.Array:
        n_in = len(self.in_shape)
        contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
        x = x.astype(self.dtype)
        y = cpu_matmul.contract(x, self.kernel[...].astype(self.dtype), n_in)
        if self.lora_a is not None:
            down = jax.lax.dot_general(x, self.lora_a[...].astype(self.dtype), (contract, ((), ())))
            up = jnp.tensordot(down, self.lora_b[...].astype(self.dtype), axes=1)
            y = y + (self.lora_scale * up).astype(self.dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y

    def merged_kernel(self) -> jax.Array:
        """``W0 + (alpha / r) A B`` in the parameter dtype; leading stacked (layer) dims are kept."""
        kernel = self.kernel[...]
        if self.lora_a is None:
            return kernel
        a, b = self.lora_a[...].astype(jnp.float32), self.lora_b[...].astype(jnp.float32)
        lead = tuple(range(a.ndim - len(self.in_shape) - 1))
        delta = jax.lax.dot_general(a, b, (((a.ndim - 1,), (len(lead),)), (lead, lead)))
        return (kernel.astype(jnp.float32) + self.lora_scale * delta).astype(kernel.dtype)


def adapters_off(lora_state: Any) -> Any:
    """The adapter state with every adapter zeroed: the model then computes the base model exactly.

    This gives the reference policy without a second copy of the base weights.
    """
    return jax.tree.map(jnp.zeros_like, lora_state)
