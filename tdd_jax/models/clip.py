"""CLIP text encoders (Radford et al. 2021) as used by SD1.5 and SDXL, in Flax NNX.

``CLIPTextModel`` (``projection_dim=None``) and ``CLIPTextModelWithProjection`` are one module:
``encoder(input_ids) -> CLIPTextOutput(last_hidden_state, penultimate_hidden_state, pooled, text_embeds)``.
SD1.5 conditions on ``last_hidden_state``; SDXL on the concatenated ``penultimate_hidden_state`` of both
encoders and on encoder 2's projected ``text_embeds``. Tokenisation goes through ``transformers``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tdd_jax.models.attention import multi_head_attention
from tdd_jax.models.layers import Embed, LayerNorm, Linear

_ACTIVATIONS = {"quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
                "gelu": lambda x: jax.nn.gelu(x, approximate=False)}


@dataclasses.dataclass(frozen=True)
class CLIPTextConfig:
    """transformers ``CLIPTextConfig`` fields; ``projection_dim`` set means ``WithProjection``."""

    vocab_size: int = 1000
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    eos_token_id: int = 2
    projection_dim: int | None = None
    dtype: str = "float32"

    def __post_init__(self):
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"clip config hidden_act={self.hidden_act!r} is not supported ({sorted(_ACTIVATIONS)})")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"clip config hidden_size={self.hidden_size} is not divisible by "
                             f"num_attention_heads={self.num_attention_heads}")

    @classmethod
    def from_transformers(cls, config: Mapping[str, Any], **overrides) -> "CLIPTextConfig":
        """Reads a ``text_encoder*/config.json`` dict; the projection follows ``architectures[0]``."""
        arch = (config.get("architectures") or ["CLIPTextModel"])[0]
        if arch not in ("CLIPTextModel", "CLIPTextModelWithProjection"):
            raise ValueError(f"text encoder architecture {arch!r} is not supported "
                             "(CLIPTextModel or CLIPTextModelWithProjection)")
        fields = {f.name for f in dataclasses.fields(cls)} - {"projection_dim", "dtype"}
        kwargs = {k: config[k] for k in fields if k in config}
        projection = config.get("projection_dim", 512) if arch == "CLIPTextModelWithProjection" else None
        return cls(**kwargs, projection_dim=projection, **overrides)


class CLIPTextOutput(NamedTuple):
    last_hidden_state: jax.Array  # final layer, after the final layer norm
    penultimate_hidden_state: jax.Array  # input of the last layer (transformers' hidden_states[-2])
    pooled: jax.Array  # last_hidden_state at the EOS token
    text_embeds: jax.Array | None  # text_projection(pooled), WithProjection only


class Embeddings(nnx.Module):
    def __init__(self, cfg: CLIPTextConfig, *, rngs: nnx.Rngs | None):
        self.token_embedding = Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs)
        self.position_embedding = Embed(cfg.max_position_embeddings, cfg.hidden_size, axes=(None, "embed"), rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return self.token_embedding(ids) + self.position_embedding(jnp.arange(ids.shape[1]))[None]


class SelfAttention(nnx.Module):
    def __init__(self, cfg: CLIPTextConfig, *, dtype, rngs: nnx.Rngs | None):
        d = cfg.hidden_size
        self.q_proj = Linear(d, d, axes=("embed", "heads"), dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d, d, axes=("embed", "heads"), dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d, d, axes=("embed", "heads"), dtype=dtype, rngs=rngs)
        self.out_proj = Linear(d, d, axes=("heads", "embed"), dtype=dtype, rngs=rngs)
        self.num_heads = cfg.num_attention_heads

    def __call__(self, x: jax.Array) -> jax.Array:
        out = multi_head_attention(self.q_proj(x), self.k_proj(x), self.v_proj(x), self.num_heads, is_causal=True)
        return self.out_proj(out)


class MLP(nnx.Module):
    def __init__(self, cfg: CLIPTextConfig, *, dtype, rngs: nnx.Rngs | None):
        self.fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, axes=("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, axes=("mlp", "embed"), dtype=dtype, rngs=rngs)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nnx.Module):
    """Pre-LN transformer layer with causal self-attention."""

    def __init__(self, cfg: CLIPTextConfig, *, dtype, rngs: nnx.Rngs | None):
        self.layer_norm1 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, rngs=rngs)
        self.self_attn = SelfAttention(cfg, dtype=dtype, rngs=rngs)
        self.layer_norm2 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, rngs=rngs)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nnx.Module):
    def __init__(self, cfg: CLIPTextConfig, *, dtype, rngs: nnx.Rngs | None):
        self.layers = nnx.List([EncoderLayer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_hidden_layers)])


class CLIPTextModel(nnx.Module):
    """CLIP text transformer; with ``cfg.projection_dim`` also the ``text_projection`` head."""

    def __init__(self, cfg: CLIPTextConfig, *, rngs: nnx.Rngs | None):
        self.cfg = cfg
        dtype = jnp.dtype(cfg.dtype)
        self.embeddings = Embeddings(cfg, rngs=rngs)
        self.encoder = Encoder(cfg, dtype=dtype, rngs=rngs)
        self.final_layer_norm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, rngs=rngs)
        self.text_projection = (Linear(cfg.hidden_size, cfg.projection_dim, use_bias=False, axes=("embed", None),
                                       dtype=dtype, rngs=rngs) if cfg.projection_dim else nnx.data(None))

    def __call__(self, input_ids: jax.Array) -> CLIPTextOutput:
        ids = jnp.asarray(input_ids)
        if ids.shape[1] > self.cfg.max_position_embeddings:
            raise ValueError(f"input_ids have {ids.shape[1]} tokens, more than max_position_embeddings="
                             f"{self.cfg.max_position_embeddings}")
        h = self.embeddings(ids)
        penultimate = h
        for layer in self.encoder.layers:
            penultimate = h
            h = layer(h)
        last = self.final_layer_norm(h)
        # Pooling at EOS: legacy configs (eos_token_id == 2) take the largest id, others the first EOS.
        eos = jnp.argmax(ids, axis=-1) if self.cfg.eos_token_id == 2 else jnp.argmax(ids == self.cfg.eos_token_id, -1)
        pooled = last[jnp.arange(ids.shape[0]), eos]
        text_embeds = self.text_projection(pooled) if self.text_projection is not None else None
        return CLIPTextOutput(last, penultimate, pooled, text_embeds)


def prompt_embeddings(outputs: Sequence[CLIPTextOutput]) -> tuple[jax.Array, jax.Array | None]:
    """UNet conditioning from the encoder outputs of a pipeline.

    One encoder (SD1.5): ``(last_hidden_state, None)``. Two encoders (SDXL, Podell et al. 2023, Sec. 2.1):
    the penultimate hidden states concatenated along features, and encoder 2's projected ``text_embeds``
    as the pooled embedding for ``added_cond_kwargs["text_embeds"]``.
    """
    if len(outputs) == 1:
        return outputs[0].last_hidden_state, None
    if len(outputs) != 2 or outputs[1].text_embeds is None:
        raise ValueError("prompt_embeddings takes one encoder output (SD1.5) or two, the second with a projection "
                         "(SDXL)")
    context = jnp.concatenate([o.penultimate_hidden_state for o in outputs], axis=-1)
    return context, outputs[1].text_embeds


def tokenize(tokenizer, prompts: Sequence[str], max_length: int | None = None) -> np.ndarray:
    """Token ids (B, max_length) padded to ``max_length`` (default the tokenizer's 77) and truncated."""
    max_length = max_length or tokenizer.model_max_length
    ids = tokenizer(list(prompts), padding="max_length", max_length=max_length, truncation=True,
                    return_tensors="np")["input_ids"]
    return ids.astype(np.int32)
