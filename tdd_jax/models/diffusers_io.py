"""Load diffusers-format folders (UNet, VAE, CLIP text encoders, tokenizers) onto target shardings.

Our modules mirror the PyTorch module tree, so a parameter's PyTorch key is its NNX path joined by
dots, after the few renames in ``MODULE_RENAMES`` and with the leaf converted by ``LEAF_RULES``:

====================  ===============================  ===========================================
ours                  PyTorch                           conversion (PyTorch -> ours)
====================  ===============================  ===========================================
``…to_out``           ``…to_out.0``                     diffusers keeps a dropout at ``to_out.1``
``…ff.geglu``         ``…ff.net.0.proj``                 GEGLU input projection
``…ff.out``           ``…ff.net.2``                     MLP output projection
``…downsampler``      ``…downsamplers.0``
``…upsampler``        ``…upsamplers.0``
``kernel`` (2-D)      ``weight`` (out, in)               transpose
``kernel`` (4-D)      ``weight`` (out, in, kh, kw)       transpose to (kh, kw, in, out)
``scale``             ``weight``                        norms
``embedding``         ``weight``                        embeddings
``bias``              ``bias``
====================  ===============================  ===========================================

``key_table(model)`` lists every (our path, PyTorch key, shape) row of a model.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterable, NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import SafetensorError, safe_open

from runtime.sharding import state_shardings
from tdd_jax.models.clip import CLIPTextConfig, CLIPTextModel
from tdd_jax.models.unet import UNet2DConditionModel, UNetConfig
from tdd_jax.models.vae import AutoencoderKL, VAEConfig

MODULE_RENAMES: tuple[tuple[str, str], ...] = (
    (".to_out.", ".to_out.0."),
    (".ff.geglu.", ".ff.net.0.proj."),
    (".ff.out.", ".ff.net.2."),
    (".downsampler.", ".downsamplers.0."),
    (".upsampler.", ".upsamplers.0."),
)
LEAF_RULES: dict[str, str] = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}
# Older checkpoints name the VAE mid-block attention like this (diffusers converts them on load too).
LEGACY_ALIASES: tuple[tuple[str, str], ...] = (
    (".to_q.", ".query."), (".to_k.", ".key."), (".to_v.", ".value."), (".to_out.0.", ".proj_attn."))
# Buffers some checkpoints carry that are not parameters.
IGNORED_SUFFIXES = ("position_ids",)


def torch_module_name(path: Iterable[Any]) -> str:
    """The PyTorch module name of the NNX module at ``path`` (e.g. ``down_blocks.0.attentions.0.proj_in``)."""
    name = "." + ".".join(str(p) for p in path) + "."
    for ours, theirs in MODULE_RENAMES:
        name = name.replace(ours, theirs)
    return name.strip(".")


def torch_key(path: tuple[Any, ...]) -> str:
    """The PyTorch state-dict key of the parameter at NNX ``path``."""
    return f"{torch_module_name(path[:-1])}.{LEAF_RULES[path[-1]]}"


def torch_to_ours(array: np.ndarray, leaf: str, target_ndim: int) -> np.ndarray:
    """Converts a PyTorch tensor to our layout for parameter ``leaf`` (``LEAF_RULES`` table)."""
    if leaf != "kernel":
        return array
    if target_ndim == 2 and array.ndim == 4 and array.shape[2:] == (1, 1):
        array = array[:, :, 0, 0]  # a 1x1 conv stored where we use a linear layer
    return array.T if array.ndim == 2 else array.transpose(2, 3, 1, 0)


def ours_to_torch(array: np.ndarray, leaf: str) -> np.ndarray:
    """Inverse of ``torch_to_ours``."""
    if leaf != "kernel":
        return array
    return array.T if array.ndim == 2 else array.transpose(3, 2, 0, 1)


class KeyRow(NamedTuple):
    """One row of the key table."""

    path: tuple[Any, ...]
    torch_key: str
    shape: tuple[int, ...]


def key_table(state: Any) -> list[KeyRow]:
    """Every ``nnx.Param`` (not LoRA) of a module or state with its PyTorch key."""
    state = state if isinstance(state, nnx.State) else nnx.state(state, nnx.Param)
    rows = []
    for path, var in nnx.to_flat_state(state):
        if isinstance(var, nnx.LoRAParam) or not isinstance(var, nnx.Param):
            continue
        rows.append(KeyRow(tuple(path), torch_key(tuple(path)), tuple(var.get_value().shape)))
    return rows


class TensorFile(NamedTuple):
    """Tensors of one or more safetensors files, with the file each key lives in."""

    files: dict[str, str]  # key -> file path

    @classmethod
    def open(cls, paths: Iterable[str]) -> "TensorFile":
        files = {}
        for path in paths:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"missing weights file {path}")
            try:
                with safe_open(path, framework="numpy") as f:
                    files.update({key: path for key in f.keys()})
            except SafetensorError as error:
                raise ValueError(f"weights file {path} is corrupt or truncated: {error}") from None
        return cls(files)

    def get(self, key: str) -> np.ndarray:
        try:
            with safe_open(self.files[key], framework="numpy") as f:
                return f.get_tensor(key)
        except (SafetensorError, TypeError, ValueError) as error:
            raise ValueError(f"tensor {key!r} in {self.files[key]} cannot be read: {error}") from None


def add_variant(name: str, variant: str | None) -> str:
    """``model.safetensors`` -> ``model.fp16.safetensors`` (the variant goes before the last suffix)."""
    if not variant:
        return name
    head, _, tail = name.rpartition(".")
    return f"{head}.{variant}.{tail}"


def weight_files(folder: str, stem: str, variant: str | None = None) -> list[str]:
    """Safetensors files of a component: ``{stem}.safetensors`` or a sharded ``….safetensors.index.json``."""
    single = os.path.join(folder, add_variant(f"{stem}.safetensors", variant))
    index = os.path.join(folder, add_variant(f"{stem}.safetensors.index.json", variant))
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, shard) for shard in shards]
    raise FileNotFoundError(f"no weights in {folder}: expected {os.path.basename(single)} or "
                            f"{os.path.basename(index)}")


def read_config(folder: str) -> dict[str, Any]:
    """``config.json`` of a component folder."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"missing {path}")
    with open(path) as f:
        return json.load(f)


def _lookup(tensors: TensorFile, key: str, alt_prefix: str) -> str | None:
    candidates = [key, alt_prefix + key] if alt_prefix else [key]
    for ours, legacy in LEGACY_ALIASES:
        candidates += [c.replace(ours, legacy) for c in candidates if ours in c]
    return next((c for c in candidates if c in tensors.files), None)


def abstract_module(constructor: Callable[[nnx.Rngs | None], nnx.Module]) -> tuple[nnx.GraphDef, nnx.State]:
    """Graph definition and ShapeDtypeStruct state of ``constructor(None)``, allocating nothing.

    Our layers built with ``rngs=None`` hold shapes only, so nothing is traced: tracing an
    initialisation (``nnx.eval_shape``) costs time quadratic in the parameter count with flax 0.12.8,
    because every ``Rngs`` update queries ``.sharding`` of a tracer.
    """
    with nnx.use_eager_sharding(False):
        return nnx.split(constructor(None))


def load_state(state: nnx.State, tensors: TensorFile, mesh: Mesh | None = None, *,
               alt_prefix: str = "") -> nnx.State:
    """Reads every parameter of the abstract ``state`` from ``tensors``.

    A key may also be found under ``alt_prefix + key`` (``text_model.`` in CLIP checkpoints).
    Each array goes straight onto its logical sharding over ``mesh`` (default device if ``None``).
    Raises naming the key and file for missing, unexpected or mis-shaped tensors.
    """
    shardings = state_shardings(state, mesh) if mesh is not None else None
    flat_shardings = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}
    used, missing, leaves = set(), [], []
    for row in key_table(state):
        key = _lookup(tensors, row.torch_key, alt_prefix)
        if key is None:
            missing.append(row.torch_key)
            continue
        used.add(key)
        array = torch_to_ours(tensors.get(key), row.path[-1], len(row.shape))
        if not jax.dtypes.issubdtype(array.dtype, np.floating):
            raise ValueError(f"tensor {key!r} in {tensors.files[key]} has dtype {array.dtype}, "
                             "expected a floating type")
        if array.shape != row.shape:
            raise ValueError(f"tensor {key!r} in {tensors.files[key]} has shape {array.shape} after conversion, "
                             f"the model expects {row.shape} (check the config)")
        sharding = flat_shardings[row.path].get_value() if shardings is not None else jax.devices()[0]
        leaves.append((row.path, jax.device_put(np.asarray(array, np.float32), sharding)))
    if missing:
        files = sorted(set(tensors.files.values()))
        raise KeyError(f"{len(missing)} tensors missing from {files}: {missing[:8]}")
    unexpected = sorted(k for k in set(tensors.files) - used if not k.endswith(IGNORED_SUFFIXES))
    if unexpected:
        raise KeyError(f"unexpected tensors in {sorted(set(tensors.files[k] for k in unexpected))} that the model "
                       f"(as configured) does not have: {unexpected[:8]}")
    flat = dict(nnx.to_flat_state(state))
    for path, value in leaves:
        flat[path] = flat[path].replace(value)
    return nnx.from_flat_state(flat)


def load_module(constructor: Callable[[nnx.Rngs | None], nnx.Module], tensors: TensorFile, mesh: Mesh | None = None,
                **kwargs) -> nnx.Module:
    """Builds ``constructor(rngs=None)`` abstractly and fills its parameters from ``tensors`` (``load_state``)."""
    graphdef, state = abstract_module(constructor)
    return nnx.merge(graphdef, load_state(state, tensors, mesh, **kwargs))


def load_unet(folder: str, mesh: Mesh | None = None, *, variant: str | None = None, **overrides) -> UNet2DConditionModel:
    """A diffusers ``unet/`` folder (config.json + safetensors); ``overrides`` set e.g. ``dtype``, ``remat``."""
    cfg = UNetConfig.from_diffusers(read_config(folder), **overrides)
    tensors = TensorFile.open(weight_files(folder, "diffusion_pytorch_model", variant))
    return load_module(lambda rngs: UNet2DConditionModel(cfg, rngs=rngs), tensors, mesh)


def load_vae(folder: str, mesh: Mesh | None = None, *, variant: str | None = None, **overrides) -> AutoencoderKL:
    """A diffusers ``vae/`` folder."""
    cfg = VAEConfig.from_diffusers(read_config(folder), **overrides)
    tensors = TensorFile.open(weight_files(folder, "diffusion_pytorch_model", variant))
    return load_module(lambda rngs: AutoencoderKL(cfg, rngs=rngs), tensors, mesh)


def load_text_encoder(folder: str, mesh: Mesh | None = None, *, variant: str | None = None,
                      **overrides) -> CLIPTextModel:
    """A transformers ``text_encoder*/`` folder (``text_model.``-prefixed keys or not)."""
    cfg = CLIPTextConfig.from_transformers(read_config(folder), **overrides)
    tensors = TensorFile.open(weight_files(folder, "model", variant))
    return load_module(lambda rngs: CLIPTextModel(cfg, rngs=rngs), tensors, mesh, alt_prefix="text_model.")


def load_tokenizer(folder: str):
    """A ``tokenizer*/`` folder through ``transformers.AutoTokenizer``."""
    from transformers import AutoTokenizer

    if not os.path.isdir(folder):
        raise FileNotFoundError(f"missing tokenizer folder {folder}")
    return AutoTokenizer.from_pretrained(folder)


class Pipeline(NamedTuple):
    """The components of a Stable Diffusion (XL) folder; absent ones are ``None``."""

    unet: UNet2DConditionModel | None
    vae: AutoencoderKL | None
    text_encoder: CLIPTextModel | None
    text_encoder_2: CLIPTextModel | None
    tokenizer: Any
    tokenizer_2: Any
    scheduler_config: dict[str, Any] | None


_LOADERS = {"unet": load_unet, "vae": load_vae, "text_encoder": load_text_encoder,
            "text_encoder_2": load_text_encoder}


def load_pipeline(folder: str, mesh: Mesh | None = None, *, variant: str | None = None,
                  components: Iterable[str] = tuple(Pipeline._fields), unet_overrides: dict | None = None) -> Pipeline:
    """Loads the ``components`` that ``model_index.json`` lists from a diffusers pipeline folder."""
    index_path = os.path.join(folder, "model_index.json")
    if not os.path.isfile(index_path):
        raise FileNotFoundError(f"{folder} is not a diffusers pipeline folder: missing model_index.json")
    with open(index_path) as f:
        index = json.load(f)
    wanted = set(components)
    unknown = wanted - set(Pipeline._fields)
    if unknown:
        raise ValueError(f"unknown pipeline components {sorted(unknown)}; known: {Pipeline._fields}")
    parts: dict[str, Any] = dict.fromkeys(Pipeline._fields)
    for name in Pipeline._fields:
        entry = index.get(name.replace("_config", ""))
        if name not in wanted or not entry or entry[0] is None:
            continue
        sub = os.path.join(folder, name.replace("_config", ""))
        if not os.path.isdir(sub):
            raise FileNotFoundError(f"model_index.json lists {name.replace('_config', '')!r} but {sub} is missing")
        if name in _LOADERS:
            overrides = (unet_overrides or {}) if name == "unet" else {}
            parts[name] = _LOADERS[name](sub, mesh, variant=variant, **overrides)
        elif name.startswith("tokenizer"):
            parts[name] = load_tokenizer(sub)
        else:
            with open(os.path.join(sub, "scheduler_config.json")) as f:
                parts[name] = json.load(f)
    return Pipeline(**parts)
