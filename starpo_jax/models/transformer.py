"""Decoder-only transformer (Qwen2/2.5, Qwen3, Llama 3.x) as a Flax NNX module.

Pre-norm blocks: ``x + Attn(RMSNorm(x))`` then ``x + SwiGLU(RMSNorm(x))``. The layers
are stacked on a leading ``layers`` axis and applied with ``jax.lax.scan``, so compile
time does not grow with depth. Inputs are left padded: ``tokens[B, T]`` with
``mask[B, T]``; position ids are derived from the mask and the cache (see ``kv_cache``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from runtime.chunked_attention import chunked_attention, query_chunk
from runtime.sharding import constrain
from starpo_jax.models import kv_cache
from starpo_jax.models.cache_attention import cache_attention
from starpo_jax.models.config import TransformerConfig
from starpo_jax.models.kv_cache import KVCache
from starpo_jax.models.lora import Dense, LoRAConfig
from starpo_jax.models.rope import apply_rope, inverse_frequencies


# Logical axes of the residual stream, pinned after the embedding, each layer and the final norm.
RESIDUAL = ("batch", "length", "act_embed")
# In a decode step (one token per row) the residual is split like the weights' ``embed`` axis instead and its
# rows are whole on every device: each device multiplies its own weight shards and only the few rows' partial
# sums move, where the batch-split residual makes every device gather every weight at every step
# (weight-stationary layout, Pope et al. 2022, sec. 3.2). Attention reads the cache's rows where they lie.
DECODE_RESIDUAL = (None, "length", "embed")


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, chunk: int = 0,
           unroll: bool = False, cpu_kernel: bool = False, filled: jax.Array | None = None) -> jax.Array:
    """``jax.nn.dot_product_attention`` of ``q[B, T, H, D]``, ``chunk`` queries at a time when ``chunk > 0``.

    Each block is rematerialised in the backward pass, so only one block's ``[B, H, chunk, S]`` scores
    are ever live instead of all ``[B, H, T, S]``; every query row's softmax is the same as unblocked.
    Without ``chunk``, ``cpu_kernel`` runs a segment of several tokens through ``_cpu_attention`` instead
    (``Decoder`` sets it in the CPU branch of its ``lax.platform_dependent``).
    With ``filled``, ``k`` and ``v`` are a layer's cache ``[B, K, S, D]`` and each block of queries reads its
    first ``filled`` slots (``cache_attention``).
    ``unroll`` unrolls the loops over blocks (for XLA's cost analysis, which counts a loop body once).
    """
    t = q.shape[1]

    def whole(q_block, mask_block):
        if filled is not None:
            return cache_attention(q_block, k, v, mask_block, filled, unroll)
        return jax.nn.dot_product_attention(q_block, k, v, mask=mask_block)

    if not chunk or t <= chunk:
        if cpu_kernel and t > 1:
            return _cpu_attention(q, k, v, mask)
        return whole(q, mask)
    blocks = -(-t // chunk)
    pad = blocks * chunk - t
    q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    mask = jnp.pad(jnp.broadcast_to(mask, (q.shape[0], mask.shape[1], t, mask.shape[-1])),
                   ((0, 0), (0, 0), (0, pad), (0, 0)))
    q_blocks = jnp.moveaxis(q.reshape(q.shape[0], blocks, chunk, *q.shape[2:]), 1, 0)
    mask_blocks = jnp.moveaxis(mask.reshape(*mask.shape[:2], blocks, chunk, mask.shape[-1]), 2, 0)
    one = jax.checkpoint(lambda block: whole(*block))
    _, out = jax.lax.scan(lambda _, block: (None, one(block)), None, (q_blocks, mask_blocks), unroll=unroll)
    out = jnp.moveaxis(out, 0, 1)
    return out.reshape(out.shape[0], blocks * chunk, *out.shape[3:])[:, :t]


def _cpu_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """``runtime.chunked_attention.chunked_attention`` with the key/value heads repeated for their query groups.

    Computed in float32 (``dot_product_attention``'s softmax is float32 too).
    """
    groups = q.shape[2] // k.shape[2]
    f32 = [x.astype(jnp.float32) for x in (q, jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2))]
    chunk = query_chunk(q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    return chunked_attention(*f32, mask, chunk).astype(q.dtype)


class RMSNorm(nnx.Module):
    """``x / sqrt(mean(x^2) + eps) * w`` (Zhang & Sennrich 2019, eq. 4), normalised in float32."""

    def __init__(self, dim: int, eps: float, param_dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.weight = nnx.Param(nnx.with_partitioning(nnx.initializers.ones_init(), ("norm",))(
            rngs.params(), (dim,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * normed.astype(x.dtype)


def _lora_for(name: str, lora: LoRAConfig | None) -> LoRAConfig | None:
    return lora if lora is not None and name in lora.targets else None


class Attention(nnx.Module):
    """Grouped-query attention (Ainslie et al. 2023) with RoPE and optional q/k RMSNorm (Qwen3)."""

    def __init__(self, config: TransformerConfig, lora: LoRAConfig | None, rngs: nnx.Rngs):
        c, e, n, k, d = config, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        kw = dict(param_dtype=c.weight_dtype, dtype=c.compute_dtype, rngs=rngs)
        self.q_proj = Dense((e,), (n, d), ("embed",), ("heads", "head_dim"), use_bias=c.attention_bias,
                            lora=_lora_for("q_proj", lora), **kw)
        self.k_proj = Dense((e,), (k, d), ("embed",), ("kv_heads", "head_dim"), use_bias=c.attention_bias,
                            lora=_lora_for("k_proj", lora), **kw)
        self.v_proj = Dense((e,), (k, d), ("embed",), ("kv_heads", "head_dim"), use_bias=c.attention_bias,
                            lora=_lora_for("v_proj", lora), **kw)
        self.o_proj = Dense((n, d), (e,), ("heads", "head_dim"), ("embed",), use_bias=c.output_bias,
                            lora=_lora_for("o_proj", lora), **kw)
        self.q_norm = RMSNorm(d, c.rms_norm_eps, c.weight_dtype, rngs) if c.qk_norm else None
        self.k_norm = RMSNorm(d, c.rms_norm_eps, c.weight_dtype, rngs) if c.qk_norm else None
        self.config = config

    def __call__(self, x, positions, mask, cache_kv=None, cpu_kernel=False):
        """Attends ``x[B, T, E]`` to itself, or to the cache after writing its keys/values there.

        Args:
          positions, mask: ``[B, T]`` position ids and validity of the segment.
          cache_kv: ``(keys, values, lengths, layer)``: this layer's cache (``layer`` None) or the stacked
            cache and this layer's index; or ``None`` (no cache).
          cpu_kernel: attend with ``runtime.chunked_attention`` (``attend``).

        Returns:
          The output ``[B, T, E]`` and the updated ``(keys, values)`` as given (``None`` without a cache).
        """
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = inverse_frequencies(self.config)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        filled = None
        if cache_kv is None:
            key_positions, key_valid, new_kv = positions, mask, None
        else:
            cache_k, cache_v, lengths, layer = cache_kv
            q = constrain(q, ("batch", "length", "act_heads", None))  # attend where the cache's rows are
            k = kv_cache.write(cache_k, k, positions, mask, layer)
            v = kv_cache.write(cache_v, v, positions, mask, layer)
            new_kv = (k, v)
            if layer is not None:
                k, v = k[layer], v[layer]
            key_positions, key_valid = kv_cache.cache_key_mask(lengths, k.shape[2])
            if cpu_kernel:
                k, v = jnp.swapaxes(k, 1, 2).astype(q.dtype), jnp.swapaxes(v, 1, 2).astype(q.dtype)
            else:  # TPU, GPU: read the filled slots only
                filled = jnp.max(lengths)
        bias_mask = kv_cache.attention_mask(positions, key_positions, key_valid)
        out = attend(q, k, v, bias_mask, self.config.attention_chunk, unroll=not self.config.scan_layers,
                     cpu_kernel=cpu_kernel, filled=filled)
        return self.o_proj(out), new_kv


class MLP(nnx.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))`` (Shazeer 2020, eq. 6)."""

    def __init__(self, config: TransformerConfig, lora: LoRAConfig | None, rngs: nnx.Rngs):
        e, m = config.hidden_size, config.intermediate_size
        kw = dict(param_dtype=config.weight_dtype, dtype=config.compute_dtype, rngs=rngs)
        self.gate_proj = Dense((e,), (m,), ("embed",), ("mlp",), lora=_lora_for("gate_proj", lora), **kw)
        self.up_proj = Dense((e,), (m,), ("embed",), ("mlp",), lora=_lora_for("up_proj", lora), **kw)
        self.down_proj = Dense((m,), (e,), ("mlp",), ("embed",), lora=_lora_for("down_proj", lora), **kw)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    """One pre-norm decoder layer."""

    def __init__(self, config: TransformerConfig, lora: LoRAConfig | None, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.weight_dtype, rngs)
        self.self_attn = Attention(config, lora, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.weight_dtype, rngs)
        self.mlp = MLP(config, lora, rngs)

    def __call__(self, x, positions, mask, cache_kv=None, cpu_kernel=False):
        h, new_kv = self.self_attn(self.input_layernorm(x), positions, mask, cache_kv, cpu_kernel)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), new_kv


class Decoder(nnx.Module):
    """Token embedding, ``num_layers`` scanned blocks and the final RMSNorm (HF ``model.*``)."""

    def __init__(self, config: TransformerConfig, lora: LoRAConfig | None, rngs: nnx.Rngs):
        self.config = config
        init = nnx.initializers.normal(config.initializer_range)
        self.embed_tokens = nnx.Param(nnx.with_partitioning(init, ("vocab", "embed"))(
            rngs.params(), (config.vocab_size, config.hidden_size), config.weight_dtype))

        @nnx.split_rngs(splits=config.num_layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stacked(layer_rngs):
            return Block(config, lora, layer_rngs)

        self.layers = stacked(rngs)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.weight_dtype, rngs)

    def __call__(self, tokens: jax.Array, mask: jax.Array, cache: KVCache | None = None):
        """Hidden states ``[B, T, E]`` of a left-padded segment, and the cache with it appended."""
        mask = mask.astype(bool)
        residual = DECODE_RESIDUAL if cache is not None and tokens.shape[1] == 1 else RESIDUAL
        lengths = jnp.zeros(tokens.shape[:1], jnp.int32) if cache is None else cache.lengths
        positions = kv_cache.segment_positions(mask, lengths)
        x = constrain(jnp.take(self.embed_tokens[...], tokens, axis=0).astype(self.config.compute_dtype), residual)
        graphdef, layer_state = nnx.split(self.layers)
        if cache is None:
            def body(h, state, cpu_kernel):
                return constrain(nnx.merge(graphdef, state)(h, positions, mask, None, cpu_kernel)[0], residual), None
            carry, xs = x, layer_state
        else:
            new_lengths = lengths + jnp.sum(mask, axis=-1, dtype=jnp.int32)

            # The cache rides in the carry and each layer's slice is updated in place: scanning it as
            # xs -> ys would hold a second full cache (the decode loop's largest buffer). On the CPU the
            # segment is scattered into the stacked cache and the layer's slice read once; XLA:CPU would
            # otherwise copy the slice out, select the new token in and copy it back (three passes per step).
            def body(carry, inputs, cpu_kernel):
                h, keys, values = carry
                state, layer = inputs
                block = nnx.merge(graphdef, state)
                if cpu_kernel:
                    h, (keys, values) = block(h, positions, mask, (keys, values, new_lengths, layer), cpu_kernel)
                else:
                    h, (k, v) = block(h, positions, mask, (keys[layer], values[layer], new_lengths, None), cpu_kernel)
                    update = lambda full, new: jax.lax.dynamic_update_index_in_dim(full, new, layer, 0)  # noqa: E731
                    keys, values = update(keys, k), update(values, v)
                return (constrain(h, residual), keys, values), None
            carry, xs = (x, cache.keys, cache.values), (layer_state, jnp.arange(self.config.num_layers))

        def layers(carry, xs, cpu_kernel):
            step = functools.partial(body, cpu_kernel=cpu_kernel)
            step = jax.checkpoint(step) if self.config.remat else step
            return jax.lax.scan(step, carry, xs, unroll=1 if self.config.scan_layers else True)[0]

        # The platform is chosen around the layer loop, not inside it: a switch inside a differentiated loop
        # leaves its branch index as a per-layer residual, and the TPU program then keeps both branches.
        carry = jax.lax.platform_dependent(carry, xs, cpu=functools.partial(layers, cpu_kernel=True),
                                           default=functools.partial(layers, cpu_kernel=False))
        if cache is None:
            return constrain(self.norm(carry), residual), None
        x, keys, values = carry
        return constrain(self.norm(x), residual), KVCache(keys, values, new_lengths)


class CausalLM(nnx.Module):
    """Decoder plus the language-model head (tied to the embedding when the config says so)."""

    def __init__(self, config: TransformerConfig, *, lora: LoRAConfig | None = None, rngs: nnx.Rngs):
        self.config = config
        self.model = Decoder(config, lora, rngs)
        self.lm_head = None if config.tie_word_embeddings else nnx.Param(
            nnx.with_partitioning(nnx.initializers.normal(config.initializer_range), ("embed", "vocab"))(
                rngs.params(), (config.hidden_size, config.vocab_size), config.weight_dtype))

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits ``[..., vocab]`` of hidden states."""
        dtype = self.config.compute_dtype
        if self.lm_head is None:
            head, dims = self.model.embed_tokens[...].astype(dtype), (((hidden.ndim - 1,), (1,)), ((), ()))
        else:
            head, dims = self.lm_head[...].astype(dtype), (((hidden.ndim - 1,), (0,)), ((), ()))
        return jax.lax.dot_general(hidden.astype(dtype), head, dims, preferred_element_type=jnp.float32)

    def __call__(self, tokens: jax.Array, mask: jax.Array, cache: KVCache | None = None):
        """Logits ``[B, T, vocab]`` (float32) and the updated cache (``None`` when none was given)."""
        hidden, cache = self.model(tokens, mask, cache)
        return self.logits(hidden), cache


class Critic(nnx.Module):
    """The same backbone with a scalar value head (HF ``...ForTokenClassification`` with one label)."""

    def __init__(self, config: TransformerConfig, *, lora: LoRAConfig | None = None, rngs: nnx.Rngs):
        self.config = config
        self.model = Decoder(config, lora, rngs)
        self.score = Dense((config.hidden_size,), (1,), ("embed",), ("value",), use_bias=True,
                           param_dtype=jnp.float32, dtype=jnp.float32, rngs=rngs)  # trained: float32 storage

    def __call__(self, tokens: jax.Array, mask: jax.Array, cache: KVCache | None = None):
        """Values ``[B, T]`` (float32): the value at token j is used for position j."""
        hidden, cache = self.model(tokens, mask, cache)
        return self.score(hidden)[..., 0], cache
