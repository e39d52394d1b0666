"""The decoder-LM config: one dataclass covering Qwen2/2.5, Qwen3 and Llama 3.x.

Built from (and written back to) a Hugging Face ``config.json``. Both the
transformers 4.x layout (``rope_theta`` + ``rope_scaling``) and the 5.x layout
(``rope_parameters``) are read.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Shape and numerics of a decoder-only transformer.

    Attributes:
      model_type: "qwen2", "qwen3" or "llama" (the Hugging Face ``model_type``).
      attention_bias: biases on the q, k and v projections (Qwen2 always; Llama/Qwen3 when set).
      output_bias: bias on the attention output projection (Llama/Qwen3 ``attention_bias``).
      qk_norm: RMSNorm over ``head_dim`` of queries and keys before RoPE (Qwen3).
      rope_type: "default" or "llama3" (Llama 3.1 frequency scaling).
      dtype: compute dtype of activations; ``param_dtype``: storage dtype of parameters.
      remat: rematerialise each layer in the backward pass (``jax.checkpoint``).
      attention_chunk: queries per attention block (``transformer.attend``); 0 attends all at once. A
        block's ``[B, H, chunk, S]`` scores are the only ones live, also in the backward pass.
      scan_layers: apply the stacked layers with ``lax.scan``; False unrolls them and every loop over
        blocks (attention blocks, log-prob chunks): longer compiles, but XLA's cost analysis then counts
        every iteration, see ``launch.compile``.
      initializer_range: standard deviation of the random token embedding (and untied LM head), as in
        Hugging Face's ``_init_weights``; projections start at ``normal(1 / sqrt(fan_in))``.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    model_type: str = "qwen2"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    output_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: bool = False
    attention_chunk: int = 0
    scan_layers: bool = True
    initializer_range: float = 0.02

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"TransformerConfig.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"TransformerConfig.num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"TransformerConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"TransformerConfig.model_type {self.model_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        if self.rope_type not in ("default", "llama3"):
            raise ValueError(f"TransformerConfig.rope_type {self.rope_type!r} is not supported (default, llama3)")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"TransformerConfig.{name} must be one of {DTYPES}, got {getattr(self, name)!r}")
        if not isinstance(self.attention_chunk, int) or self.attention_chunk < 0:
            raise ValueError(f"TransformerConfig.attention_chunk must be an integer >= 0, got {self.attention_chunk!r}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0 or self.initializer_range <= 0:
            raise ValueError("TransformerConfig.rms_norm_eps, rope_theta and initializer_range must be positive")

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids as a tuple (HF configs give an int or a list)."""
        if self.eos_token_id is None:
            return ()
        return (self.eos_token_id,) if isinstance(self.eos_token_id, int) else tuple(self.eos_token_id)

    @classmethod
    def from_hf(cls, hf: dict[str, Any] | str | Path, **overrides: Any) -> "TransformerConfig":
        """Reads a Hugging Face ``config.json`` (a dict, the file, or its folder).

        ``overrides`` set fields the file does not hold (``dtype``, ``param_dtype``, ``remat``).
        """
        source = "config dict"
        if not isinstance(hf, dict):
            path = Path(hf)
            path = path / "config.json" if path.is_dir() else path
            if not path.is_file():
                raise FileNotFoundError(f"no config.json at {path}")
            source = str(path)
            hf = json.loads(path.read_text())
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"{source}: model_type {model_type!r} (architectures {hf.get('architectures')}) is not "
                             f"supported; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if hf.get("use_sliding_window"):
            raise ValueError(f"{source}: use_sliding_window=True is not supported")
        if hf.get("mlp_bias"):
            raise ValueError(f"{source}: mlp_bias=True is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {hf['hidden_act']!r} is not supported (silu)")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in hf]
        if missing:
            raise KeyError(f"{source}: missing field(s) {', '.join(missing)}")
        num_heads = hf["num_attention_heads"]
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"{source}: rope type {rope_type!r} is not supported (default, llama3)")
        llama3 = rope_type == "llama3"
        bias = bool(hf.get("attention_bias", False))
        eos = hf.get("eos_token_id")
        fields = dict(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"], num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            model_type=model_type, rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=float(rope_theta),
            rope_type=rope_type,
            rope_factor=float(rope["factor"]) if llama3 else 1.0,
            rope_low_freq_factor=float(rope["low_freq_factor"]) if llama3 else 1.0,
            rope_high_freq_factor=float(rope["high_freq_factor"]) if llama3 else 4.0,
            rope_original_max_position=int(rope["original_max_position_embeddings"]) if llama3 else 8192,
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            attention_bias=True if model_type == "qwen2" else bias,
            output_bias=model_type != "qwen2" and bias,
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"), pad_token_id=hf.get("pad_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            initializer_range=float(hf.get("initializer_range", 0.02)),
        )
        fields.update(overrides)
        return cls(**fields)

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` dict that ``transformers`` reads back into the same model."""
        rope: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        if self.rope_type == "llama3":
            rope.update(factor=self.rope_factor, low_freq_factor=self.rope_low_freq_factor,
                        high_freq_factor=self.rope_high_freq_factor,
                        original_max_position_embeddings=self.rope_original_max_position)
        hf = dict(
            architectures=[ARCHITECTURES[self.model_type]], model_type=self.model_type,
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim, hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta, rope_parameters=rope,
            max_position_embeddings=self.max_position_embeddings, tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id, pad_token_id=self.pad_token_id,
            eos_token_id=list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            torch_dtype=self.param_dtype, dtype=self.param_dtype, initializer_range=self.initializer_range,
        )
        if self.rope_type == "llama3":
            hf["rope_scaling"] = rope
        if self.model_type != "qwen2":
            hf["attention_bias"] = self.attention_bias
        return hf
