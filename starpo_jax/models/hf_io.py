"""Hugging Face checkpoints in and out.

``load_pretrained`` reads a folder (or a hub-cache id) straight onto the target
shardings: every device shard is cut from the memory-mapped safetensors data, so no
full host copy of a stacked parameter is built. ``save_pretrained`` writes a folder
that ``transformers`` loads; ``save_peft_adapter`` writes the LoRA adapters in PEFT
format. Stacked layer parameters ``[layers, ...]`` map to ``model.layers.{i}.*``.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from runtime.mesh import LOGICAL_AXIS_RULES
from runtime.sharding import state_shardings
from starpo_jax.models.config import TransformerConfig
from starpo_jax.models.lora import LoRAConfig
from starpo_jax.models.safetensors_io import INDEX_FILE, SafetensorsIndex, write_file, write_sharded
from starpo_jax.models.transformer import CausalLM, Critic

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_folder(name_or_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """A local folder, or the snapshot of a hub id already in the local Hugging Face cache (never downloads)."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if path.exists():
        raise NotADirectoryError(f"{path} is not a folder")
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(str(name_or_path), cache_dir=cache_dir, local_files_only=True))
    except Exception as e:  # huggingface_hub raises several types for a missing or invalid id
        raise FileNotFoundError(f"{name_or_path!r} is neither a local folder nor a model in the local "
                                f"Hugging Face cache ({type(e).__name__}: {e})") from None


def check_model_folder(name_or_path: str | Path) -> Path:
    """The resolved model folder, after checking that it holds ``config.json`` and safetensors weights.

    Raises ``FileNotFoundError`` naming the folder and what it lacks (before any tokenizer or model loads).
    """
    folder = resolve_folder(name_or_path)
    lacking = [] if (folder / "config.json").is_file() else ["config.json"]
    if not (folder / INDEX_FILE).is_file() and not any(folder.glob("*.safetensors")):
        lacking.append(f"*.safetensors weights or {INDEX_FILE}")
    if lacking:
        raise FileNotFoundError(f"model_path {folder} is not a Hugging Face model folder: it lacks "
                                f"{' and '.join(lacking)}")
    return folder


@contextlib.contextmanager
def _abstract_context():
    """Build annotated variables without placing them (as ``runtime.sharding.create_sharded``)."""
    with nnx.use_eager_sharding(False), nnx.logical_axis_rules(tuple(LOGICAL_AXIS_RULES.items())):
        yield


def _split_dims(path: tuple[str, ...]) -> int | None:
    """How many leading dims of our array form HF's input dim (HF stores ``[out, in]``); None = same layout."""
    leaf = path[-1]
    if leaf == "kernel":
        return 2 if "o_proj" in path else 1
    if leaf == "lm_head":
        return 1
    if leaf == "lora_a":
        return -1
    if leaf == "lora_b":
        return 1
    return None


def hf_key(path: tuple[str, ...], layer: int | None) -> str:
    """The HF tensor name of our parameter ``path`` (layer ``layer`` of a stacked one)."""
    parts = list(path)
    if layer is not None:
        parts.insert(parts.index("layers") + 1, str(layer))
    leaf = parts.pop()
    suffix = {"kernel": "weight", "bias": "bias", "weight": "weight",
              "lora_a": "lora_A.weight", "lora_b": "lora_B.weight"}.get(leaf)
    if suffix is None:
        parts.append(leaf)
        suffix = "weight"
    return ".".join(parts + [suffix])


def to_hf(path: tuple[str, ...], x: np.ndarray) -> np.ndarray:
    """Our layout of one (per-layer) parameter -> HF layout."""
    split = _split_dims(path)
    if split is not None:
        split = x.ndim - 1 if split == -1 else split
        return x.reshape(math.prod(x.shape[:split]), -1).T
    return x.reshape(-1) if path[-1] == "bias" else x


def hf_shape(path: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF shape of a (per-layer) parameter of our ``shape``."""
    return to_hf(path, np.empty(shape, np.uint8)).shape


def from_hf(path: tuple[str, ...], w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """HF layout -> our layout of one (per-layer) parameter."""
    return (w.T if _split_dims(path) is not None else w).reshape(shape)


def _flat_params(state: nnx.State) -> dict[tuple[str, ...], Any]:
    return {tuple(str(k) for k in path): v for path, v in nnx.to_flat_state(state)}


def _expected_keys(path: tuple[str, ...], shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    if "layers" in path:
        return [(hf_key(path, i), hf_shape(path, shape[1:])) for i in range(shape[0])]
    return [(hf_key(path, None), hf_shape(path, shape))]


def _reader(index: SafetensorsIndex, path: tuple[str, ...], shape: tuple[int, ...], dtype) -> Callable:
    """Callback for ``jax.make_array_from_callback``: one device shard, cut from memory-mapped tensors."""
    stacked = "layers" in path

    def read(slices):
        if not stacked:
            return from_hf(path, index.get(hf_key(path, None)), shape)[slices].astype(dtype)
        layers = range(shape[0])[slices[0]]
        return np.stack([from_hf(path, index.get(hf_key(path, i)), shape[1:])[slices[1:]].astype(dtype)
                         for i in layers])

    return read


def _check_tensors(index: SafetensorsIndex, expected: dict[str, tuple[int, ...]], allowed: set[str],
                   folder: Path) -> None:
    """Raises on missing, unexpected or mis-shaped tensors, naming the key and the file."""
    missing = sorted(k for k in expected if k not in index)
    if missing:
        raise KeyError(f"checkpoint {folder} lacks tensor(s) {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    unexpected = sorted(k for k in index.tensors if k not in expected and k not in allowed
                        and not k.endswith(IGNORED_SUFFIXES))
    if unexpected:
        raise KeyError(f"checkpoint {folder} has unexpected tensor(s) {unexpected[:8]} "
                       f"(in {index.tensors[unexpected[0]].file.name})")
    for key, shape in expected.items():
        info = index.tensors[key]
        if info.shape != shape:
            raise ValueError(f"tensor {key!r} in {info.file.name} has shape {info.shape}, expected {shape}")
        if not jax.dtypes.issubdtype(info.dtype, np.floating):
            raise ValueError(f"tensor {key!r} in {info.file.name} has dtype {info.dtype}, expected a floating type")


def load_pretrained(name_or_path: str | Path, mesh: Mesh, *, critic: bool = False, lora: LoRAConfig | None = None,
                    seed: int = 0, **config_overrides: Any) -> CausalLM | Critic:
    """Builds a ``CausalLM`` (or a ``Critic``) from a HF checkpoint, each tensor placed on its sharding.

    The critic's value head and LoRA adapters are initialised randomly from ``seed``
    (LoRA B at zero) when the checkpoint lacks them (a critic checkpoint holds ``score``).
    Raises before anything is placed when a key is missing or unexpected or a shape
    does not match, naming the key and the file.
    """
    folder = resolve_folder(name_or_path)
    config = TransformerConfig.from_hf(folder, **config_overrides)
    index = SafetensorsIndex.from_folder(folder)
    cls = Critic if critic else CausalLM
    constructor = lambda: cls(config, lora=lora, rngs=nnx.Rngs(seed))  # noqa: E731
    with _abstract_context():
        graphdef, abstract = nnx.split(nnx.eval_shape(constructor))
    params = _flat_params(abstract)
    optional = [p for p in params if p[-1] in ("lora_a", "lora_b") or p[0] == "score"]
    fresh = {p for p in optional
             if not any(k in index for k, _ in _expected_keys(p, params[p].get_value().shape))}
    expected: dict[str, tuple[int, ...]] = {}
    for path, variable in params.items():
        if path not in fresh:
            expected.update(_expected_keys(path, variable.get_value().shape))
    allowed = {"lm_head.weight"} if (critic or config.tie_word_embeddings) else set()
    _check_tensors(index, expected, allowed, folder)
    shardings = _flat_params(state_shardings(abstract, mesh))
    initial = _initialise(constructor, abstract, mesh, fresh)
    flat = []
    for path, variable in params.items():
        shape, dtype = variable.get_value().shape, variable.get_value().dtype
        value = initial[path] if path in fresh else jax.make_array_from_callback(
            shape, shardings[path].get_value(), _reader(index, path, shape, dtype))
        flat.append((path, variable.replace(value)))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _initialise(constructor: Callable[[], nnx.Module], abstract: nnx.State, mesh: Mesh,
                paths: set[tuple[str, ...]]) -> dict[tuple[str, ...], jax.Array]:
    """Random initial values of only ``paths`` (the rest of the initialiser is dead code to XLA)."""
    if not paths:
        return {}
    shardings = _flat_params(state_shardings(abstract, mesh))

    def init():
        flat = _flat_params(nnx.state(constructor()))
        return {"/".join(p): flat[p].get_value() for p in paths}

    with _abstract_context():
        values = jax.jit(init, out_shardings={"/".join(p): shardings[p].get_value() for p in paths})()
    return {p: values["/".join(p)] for p in paths}


def _host(x: jax.Array) -> np.ndarray:
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def _hf_tensors(flat: dict[tuple[str, ...], Any], rename: Callable[[str], str] = lambda k: k):
    """HF-named host tensors of flat ``{path: variable}`` parameters."""
    tensors = {}
    for path, variable in flat.items():
        value = _host(variable.get_value())
        layers = range(value.shape[0]) if "layers" in path else [None]
        for i in layers:
            tensors[rename(hf_key(path, i))] = np.ascontiguousarray(to_hf(path, value if i is None else value[i]))
    return tensors


def merge_lora(model: CausalLM | Critic) -> nnx.State:
    """The model's base parameters with every adapter folded in: ``W0 + (alpha / r) A B``."""
    state = nnx.state(model, nnx.Not(nnx.LoRAParam))
    for path, module in nnx.iter_graph(model):
        if getattr(module, "lora_a", None) is not None:
            target = state
            for key in path:
                target = target[key]
            target["kernel"].set_value(module.merged_kernel())
    return state


def save_pretrained(model: CausalLM | Critic, folder: str | Path, *, tokenizer: Any = None,
                    max_shard_bytes: int = 4 << 30) -> Path:
    """Writes a folder ``transformers`` loads: config.json, safetensors (LoRA merged), tokenizer files.

    A ``Critic`` is written as ``...ForTokenClassification`` with one label.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = _hf_tensors(_flat_params(merge_lora(model)))
    hf = model.config.to_hf()
    if isinstance(model, Critic):
        hf["architectures"] = [hf["architectures"][0].replace("ForCausalLM", "ForTokenClassification")]
        hf.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    if jax.process_index() == 0:
        write_sharded(folder, tensors, max_shard_bytes)
        (folder / "config.json").write_text(json.dumps(hf, indent=2))
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
    return folder


def save_peft_adapter(model: CausalLM, folder: str | Path, lora: LoRAConfig, base_model: str = "") -> Path:
    """Writes ``adapter_model.safetensors`` + ``adapter_config.json`` in PEFT's LoRA format."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = _hf_tensors(_flat_params(nnx.state(model, nnx.LoRAParam)), lambda k: "base_model.model." + k)
    if not tensors:
        raise ValueError("the model has no LoRA adapters to save")
    adapter_config = dict(peft_type="LORA", task_type="CAUSAL_LM", r=lora.rank, lora_alpha=lora.alpha,
                          target_modules=sorted(lora.targets), lora_dropout=0.0, bias="none",
                          fan_in_fan_out=False, base_model_name_or_path=base_model, inference_mode=True)
    if jax.process_index() == 0:
        write_file(folder / "adapter_model.safetensors", tensors)
        (folder / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return folder
