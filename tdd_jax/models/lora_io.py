"""UNet LoRA files: import kohya / PEFT / old diffusers keys, export what diffusers loads.

Per adapted module ``name`` (its PyTorch module name):

======================  =============================================  ==========================
format                  keys                                           alpha
======================  =============================================  ==========================
PEFT / diffusers        ``unet.{name}.lora_A.weight``, ``lora_B``      safetensors metadata
                                                                       ``lora_adapter_metadata``
                                                                       (``unet.lora_alpha``), else r
old diffusers           ``unet.{name}.lora.down.weight``, ``lora.up``  r
kohya (TDD's export)    ``lora_unet_{name with _}.lora_down.weight``,  ``….alpha`` tensor, else r
                        ``lora_up.weight``, ``.alpha``
======================  =============================================  ==========================

A (down) is (r, in) or, for convs, (r, in, kh, kw); B (up) is (out, r) or (out, r, 1, 1).
"""

from __future__ import annotations

import json
import re
from typing import Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from tdd_jax.models.diffusers_io import ours_to_torch, torch_to_ours
from tdd_jax.models.layers import Conv
from tdd_jax.models.lora import LoRA, named_layers

METADATA_KEY = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY
_PEFT = re.compile(r"^(?:unet\.|base_model\.model\.)?(?P<name>.+)\.(?P<part>lora_A|lora_B|lora\.down|lora\.up)\.weight$")
_KOHYA = re.compile(r"^lora_unet_(?P<name>.+)\.(?P<part>lora_down\.weight|lora_up\.weight|alpha)$")
_PART = {"lora_A": "a", "lora.down": "a", "lora_down.weight": "a",
         "lora_B": "b", "lora.up": "b", "lora_up.weight": "b", "alpha": "alpha"}


def _adapters(model: nnx.Module) -> dict[str, LoRA]:
    return {name: m.lora for name, m in named_layers(model).items() if m.lora is not None}


def _torch_a_b(adapter: LoRA) -> tuple[np.ndarray, np.ndarray]:
    a = ours_to_torch(np.asarray(adapter.lora_a.get_value()), "kernel")
    b = np.asarray(adapter.lora_b.get_value()).T
    return a, (b[:, :, None, None] if adapter.conv is not None else b)


def export_peft(model: nnx.Module, path: str) -> None:
    """Writes ``unet.*.lora_A/B.weight`` with the LoraConfig in the metadata (diffusers ``load_lora_weights``)."""
    adapters = _adapters(model)
    if not adapters:
        raise ValueError("the model has no LoRA adapters to export")
    ranks = {a.lora_b.get_value().shape[0] for a in adapters.values()}
    alphas = {a.scale * a.lora_b.get_value().shape[0] for a in adapters.values()}
    if len(ranks) != 1 or len(alphas) != 1:
        raise ValueError(f"export_peft needs one rank and alpha for all adapters, got ranks {ranks}, alphas {alphas}")
    tensors = {}
    for name, adapter in adapters.items():
        a, b = _torch_a_b(adapter)
        tensors[f"unet.{name}.lora_A.weight"] = np.ascontiguousarray(a)
        tensors[f"unet.{name}.lora_B.weight"] = np.ascontiguousarray(b)
    config = {"unet.r": ranks.pop(), "unet.lora_alpha": alphas.pop(), "unet.target_modules": sorted(adapters)}
    save_file(tensors, path, metadata={"format": "pt", METADATA_KEY: json.dumps(config)})


def export_kohya(model: nnx.Module, path: str) -> None:
    """Writes kohya keys ``lora_unet_*.lora_down/lora_up.weight`` and ``.alpha`` (the reference's export)."""
    tensors = {}
    for name, adapter in _adapters(model).items():
        a, b = _torch_a_b(adapter)
        key = "lora_unet_" + name.replace(".", "_")
        tensors[f"{key}.lora_down.weight"] = np.ascontiguousarray(a)
        tensors[f"{key}.lora_up.weight"] = np.ascontiguousarray(b)
        tensors[f"{key}.alpha"] = np.asarray(adapter.scale * a.shape[0], np.float32)
    if not tensors:
        raise ValueError("the model has no LoRA adapters to export")
    save_file(tensors, path)


def read_lora_file(path: str) -> tuple[dict[str, np.ndarray], float | None]:
    """Tensors of a LoRA safetensors file and the ``lora_alpha`` of its metadata, if any."""
    with safe_open(path, framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata() or {}
    config = json.loads(metadata.get(METADATA_KEY, "{}"))
    alpha = config.get("unet.lora_alpha", config.get("lora_alpha"))
    return tensors, alpha


def import_lora(model: nnx.Module, tensors: Mapping[str, np.ndarray], alpha: float | None = None) -> list[str]:
    """Sets adapters on ``model`` (in place) from kohya, PEFT or old diffusers keys; returns module names.

    ``alpha`` applies to adapters without a kohya ``.alpha`` (default: their rank, i.e. scale 1).
    """
    parts: dict[str, dict[str, np.ndarray]] = {}
    origin: dict[str, str] = {}  # one file key per module, for error messages
    for key, value in tensors.items():
        match = _KOHYA.match(key) or _PEFT.match(key)
        if match is None:
            raise KeyError(f"LoRA key {key!r} is neither kohya (lora_unet_*), PEFT (*.lora_A/B.weight) "
                           "nor old diffusers (*.lora.down/up.weight)")
        parts.setdefault(match["name"], {})[_PART[match["part"]]] = np.asarray(value, np.float32)
        origin.setdefault(match["name"], key)
    modules = named_layers(model)
    kohya = {name.replace(".", "_"): name for name in modules}
    loaded = []
    for key, part in parts.items():
        name = key if key in modules else kohya.get(key)
        if name is None:
            raise KeyError(f"LoRA key {origin[key]!r} matches no linear or conv layer of the model")
        if "a" not in part or "b" not in part:
            raise KeyError(f"LoRA key {origin[key]!r} needs both down (A) and up (B) matrices in the file")
        base = modules[name]
        a = torch_to_ours(part["a"], "kernel", base.kernel.get_value().ndim)
        b = part["b"].reshape(part["b"].shape[0], -1).T
        rank = a.shape[-1]
        if a.shape[:-1] != base.kernel.get_value().shape[:-1] or b.shape != (rank, base.kernel.get_value().shape[-1]):
            raise ValueError(f"LoRA weights for {name!r}: A {part['a'].shape} and B {part['b'].shape} do not fit "
                             f"the layer's kernel {base.kernel.get_value().shape}")
        if isinstance(base, Conv) != (a.ndim == 4):
            raise ValueError(f"LoRA weights for {name!r} do not match the layer type ({type(base).__name__})")
        adapter_alpha = float(part["alpha"]) if "alpha" in part else (alpha if alpha is not None else rank)
        with nnx.use_eager_sharding(False):
            adapter = LoRA(base, rank, adapter_alpha, rng=np.random.default_rng(0))
        adapter.lora_a.set_value(jnp.asarray(a))
        adapter.lora_b.set_value(jnp.asarray(b))
        base.lora = adapter
        loaded.append(name)
    return sorted(loaded)
