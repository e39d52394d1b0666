"""Low-rank adapters (Hu et al. 2021) on the UNet's linear and conv layers.

``W' = W + (alpha / r) B A`` (eq. 3). For a conv, A is a k x k conv to r channels with the base
conv's stride and padding, and B a 1 x 1 conv (as PEFT does). A is Kaiming-uniform, B zero, so a
fresh adapter leaves the model unchanged. Adapter weights are ``nnx.LoRAParam``s: train only them with

    graphdef, lora, base = nnx.split(unet, nnx.LoRAParam, ...)

and run the frozen base model with ``unet(..., lora_scale=0.0)``, which skips every adapter.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from runtime.cpu_matmul import contract
from runtime.sharding import shard_state
from tdd_jax.models.diffusers_io import torch_module_name
from tdd_jax.models.layers import Conv, Linear, conv2d

# The reference's target modules (TDD train_tdd.py, LoraConfig target_modules), PyTorch names.
TDD_TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2",
                      "conv1", "conv2", "conv_shortcut", "downsamplers.0.conv", "upsamplers.0.conv", "time_emb_proj")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Rank ``r``, ``alpha`` (PEFT's default 8, as the reference uses with r = 64) and target modules."""

    rank: int = 64
    alpha: float = 8.0
    target_modules: tuple[str, ...] = TDD_TARGET_MODULES

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"lora rank must be >= 1, got {self.rank}")
        if not self.target_modules:
            raise ValueError("lora target_modules is empty")

    def targets(self, name: str) -> bool:
        """PEFT's rule: a module is adapted if its name equals a target or ends with ``.target``."""
        return any(name == t or name.endswith("." + t) for t in self.target_modules)


class LoRA(nnx.Module):
    """``delta(x) = (alpha / r) B(A(x))`` for the base layer it was built for."""

    def __init__(self, base: Linear | Conv, rank: int, alpha: float, *, rng: np.random.Generator):
        axes = base.kernel.get_metadata().get("out_sharding") or (None,) * base.kernel.get_value().ndim
        shape = base.kernel.get_value().shape
        bound = 1.0 / math.sqrt(math.prod(shape[:-1]))  # kaiming_uniform_(a=sqrt(5)), PEFT's default for A
        a = rng.uniform(-bound, bound, (*shape[:-1], rank)).astype(np.float32)
        self.lora_a = nnx.LoRAParam(jnp.asarray(a), out_sharding=(*axes[:-1], "lora_rank"))
        self.lora_b = nnx.LoRAParam(jnp.zeros((rank, shape[-1]), jnp.float32), out_sharding=("lora_rank", axes[-1]))
        self.scale = alpha / rank
        self.conv = (base.stride, base.padding) if isinstance(base, Conv) else None

    def __call__(self, x: jax.Array) -> jax.Array:
        a = self.lora_a.get_value().astype(x.dtype)
        h = contract(x, a) if self.conv is None else conv2d(x, a, *self.conv)
        return self.scale * contract(h, self.lora_b.get_value().astype(x.dtype))


def named_layers(model: nnx.Module) -> dict[str, Linear | Conv]:
    """PyTorch module name -> our layer, for every Linear and Conv of ``model``."""
    return {torch_module_name(path): module for path, module in nnx.iter_modules(model)
            if isinstance(module, (Linear, Conv))}


def adaptable_modules(model: nnx.Module, config: LoraConfig) -> dict[str, Linear | Conv]:
    """The layers of ``model`` that ``config`` targets, by PyTorch module name."""
    return {name: module for name, module in named_layers(model).items() if config.targets(name)}


def add_lora(model: nnx.Module, config: LoraConfig, rngs: nnx.Rngs, mesh: Mesh | None = None) -> list[str]:
    """Attaches a fresh adapter to every targeted layer (in place); returns their PyTorch names.

    With ``mesh`` the adapter weights are placed on their logical shardings.
    """
    modules = adaptable_modules(model, config)
    if not modules:
        raise ValueError(f"lora target_modules {config.target_modules} match no linear or conv layer of the model")
    # One host generator seeded from ``rngs``: drawing on the host avoids compiling one kernel per shape.
    rng = np.random.default_rng(np.asarray(jax.random.key_data(rngs.params())))
    with nnx.use_eager_sharding(False):
        for module in modules.values():
            module.lora = LoRA(module, config.rank, config.alpha, rng=rng)
    if mesh is not None:
        nnx.update(model, shard_state(nnx.state(model, nnx.LoRAParam), mesh))
    return sorted(modules)
