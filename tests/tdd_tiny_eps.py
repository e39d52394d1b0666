"""A tiny but real NNX ε-network with LoRA conv adapters, following ``tdd_jax.sampler.EpsModel``.

Used by the TDD sampler and distillation tests because it compiles far faster than the real UNet;
it has the pieces those steps touch: a sinusoidal timestep embedding, cross-conditioning on a context sequence and SDXL-style
pooled ``text_embeds``, logical axis names for sharding, and LoRA variables (``nnx.LoRAParam``)
skipped at ``lora_scale=0`` like the real UNet's.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from runtime.mesh import LOGICAL_AXIS_RULES
from runtime.sharding import shard_state


CONV_AXES = ("conv_kernel", "conv_kernel", "conv_in", "conv_out")


class LoRAConv(nnx.Module):
    """3×3 conv plus ``(alpha/r)·B(A(x))`` with A a 3×3 conv to r channels and B a 1×1 conv."""

    def __init__(self, cin: int, cout: int, rank: int, rngs: nnx.Rngs, alpha: float = 2.0):
        init = nnx.initializers.lecun_normal()
        self.base = nnx.Conv(cin, cout, (3, 3), padding="SAME", rngs=rngs,
                             kernel_init=nnx.with_partitioning(init, CONV_AXES),
                             bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("conv_out",)))
        self.lora_a = nnx.LoRAParam(jax.random.normal(rngs.params(), (3, 3, cin, rank)),
                                    out_sharding=("conv_kernel", "conv_kernel", "conv_in", "lora_rank"))
        # B is non-zero (unlike PEFT's zero init) so that the LoRA path is active from the first step in tests.
        self.lora_b = nnx.LoRAParam(jax.random.normal(rngs.params(), (rank, cout)),
                                    out_sharding=("lora_rank", "conv_out"))
        self.scale = alpha / rank

    def __call__(self, x, lora_scale=1.0):
        if lora_scale == 0.0:
            return self.base(x)
        down = jax.lax.conv_general_dilated(x, self.lora_a[...], (1, 1), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return self.base(x) + lora_scale * self.scale * down @ self.lora_b[...]


def timestep_embedding(t, dim):
    half = dim // 2
    freqs = jnp.exp(-jnp.log(10000.0) * jnp.arange(half) / half)
    args = t.astype(jnp.float32)[:, None] * freqs[None]
    return jnp.concatenate([jnp.sin(args), jnp.cos(args)], axis=-1)


class TinyEpsNet(nnx.Module):
    """``model(x, t, context, added_cond=None, *, lora_scale=1.0) -> ε`` on NHWC latents."""

    def __init__(self, rngs: nnx.Rngs, channels: int = 4, width: int = 16, context_dim: int = 8,
                 pooled_dim: int = 8, rank: int = 2):
        dense = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
        self.width = width
        self.conv_in = LoRAConv(channels, width, rank, rngs)
        self.conv_mid = LoRAConv(width, width, rank, rngs)
        self.conv_out = LoRAConv(width, channels, rank, rngs)
        self.time_proj = nnx.Linear(width, width, kernel_init=dense, rngs=rngs)
        self.context_proj = nnx.Linear(context_dim, width, kernel_init=dense, rngs=rngs)
        self.pooled_proj = nnx.Linear(pooled_dim, width, kernel_init=dense, rngs=rngs)

    def __call__(self, x, t, context, added_cond=None, *, lora_scale=1.0):
        emb = self.time_proj(timestep_embedding(t, self.width)) + self.context_proj(jnp.mean(context, axis=1))
        if added_cond is not None:
            emb = emb + self.pooled_proj(added_cond["text_embeds"])
        h = jax.nn.silu(self.conv_in(x, lora_scale) + emb[:, None, None, :])
        h = jax.nn.silu(self.conv_mid(h, lora_scale))
        return self.conv_out(h, lora_scale)


def build_tiny_eps_net(seed: int = 0, mesh=None, **kwargs) -> TinyEpsNet:
    """A ``TinyEpsNet`` with NumPy-drawn weights (no per-parameter compilation on a busy CPU).

    Kernels ~ N(0, 1/fan_in), biases zero, LoRA variables scaled by 0.3; placed on their logical
    shardings over ``mesh`` when given, else on the default device.
    """
    with nnx.use_eager_sharding(False), nnx.logical_axis_rules(tuple(LOGICAL_AXIS_RULES.items())):
        graphdef, state = nnx.split(nnx.eval_shape(lambda: TinyEpsNet(nnx.Rngs(0), **kwargs)))
    rng = np.random.default_rng(seed)

    def draw(variable):
        shape = variable.get_value().shape
        if len(shape) < 2:
            return variable.replace(jnp.zeros(shape, jnp.float32))
        value = rng.normal(size=shape) / np.sqrt(np.prod(shape[:-1]))
        if isinstance(variable, nnx.LoRAParam):
            value = 0.3 * value
        return variable.replace(jnp.asarray(value, jnp.float32))

    state = jax.tree.map(draw, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    if mesh is not None:
        state = shard_state(state, mesh)
    return nnx.merge(graphdef, state)
