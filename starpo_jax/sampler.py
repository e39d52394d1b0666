"""Compiled autoregressive sampling: one prefill, then a ``lax.while_loop`` of cached decode steps.

Every row stops on its own (stop ids, stop strings, length cap); the loop ends when
all rows have stopped. Each generated token, the stop token included, is written to
the KV cache, so the returned cache continues into the next turn. On the CPU each
cached call runs on the cache's filled slots only (``on_filled_slots``); on a TPU or GPU
each layer's attention reads the filled blocks of the whole cache (``starpo_jax.models.cache_attention``)
and a decode step leaves every weight shard where it is (``starpo_jax.models.transformer.DECODE_RESIDUAL``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax.sharding import Mesh

from runtime.sharding import constrain
from starpo_jax.models.kv_cache import KVCache, cache_shardings
from starpo_jax.models.transformer import DECODE_RESIDUAL


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """Decoding settings (static: a change compiles a new sampler).

    Attributes:
      max_new_tokens: length cap per call.
      temperature: softmax temperature; ignored when ``greedy``.
      top_p: nucleus mass (Holtzman et al. 2020); 1.0 disables it.
      top_k: keep the k most likely tokens; 0 disables it.
      greedy: take the argmax instead of sampling.
      stop_ids: token ids that end a row (they are kept in the output).
      pad_id: filler of the output after a row's end.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    stop_ids: tuple[int, ...] = ()
    pad_id: int = 0

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(f"SamplerConfig.max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"SamplerConfig.temperature must be positive (or set greedy=True), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplerConfig.top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplerConfig.top_k must be a non-negative integer, got {self.top_k!r}")


class StopStrings(NamedTuple):
    """Token-level automaton of stop strings (``starpo_jax.tokenizer.stop_string_automaton``).

    ``transitions[n, state, token]`` is the next match state of string ``n``;
    reaching ``lengths[n]`` means the string has appeared in the generated text.
    """

    transitions: jax.Array
    lengths: jax.Array


class Sample(NamedTuple):
    """Generated ``tokens[B, N]``, their ``log_probs[B, N]``, ``lengths[B]`` and the continued cache.

    Log-probs are under ``softmax(logits / temperature)`` before top-k/top-p truncation
    (the model's own log-probs at temperature 1 or greedy); entries past a row's length are 0.
    """

    tokens: jax.Array
    log_probs: jax.Array
    lengths: jax.Array
    cache: KVCache


def filter_logits(logits: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Sets to -inf the logits outside the top k and outside the smallest set with mass >= top_p."""
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        cutoff = jnp.min(jnp.where(mass_before < top_p, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


def choose(logits: jax.Array, key: jax.Array, config: SamplerConfig,
           rows: tuple[jax.Array, int] | None = None) -> tuple[jax.Array, jax.Array]:
    """Next tokens ``[B]`` and their log-probabilities under ``softmax(logits / temperature)``.

    ``rows``: ``(indices[B], total)`` when these rows are a slice of a ``total``-row batch: each row then takes
    the Gumbel noise of its index in the whole batch (``jax.random.categorical``'s draw of ``[total, V]``
    logits), so a batch played in slices samples what it samples whole.
    """
    temperature = 1.0 if config.greedy else config.temperature
    log_probs = jax.nn.log_softmax(logits / temperature, axis=-1)
    if config.greedy:
        tokens = jnp.argmax(logits, axis=-1)
    else:
        filtered = filter_logits(log_probs, config.top_k, config.top_p)
        if rows is None:
            tokens = jax.random.categorical(key, filtered, axis=-1)
        else:
            indices, total = rows
            noise = jax.random.gumbel(key, (total, logits.shape[-1]), log_probs.dtype)[indices]
            tokens = jnp.argmax(noise + filtered, axis=-1)
    return tokens.astype(jnp.int32), jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]


class _Loop(NamedTuple):
    step: jax.Array
    token: jax.Array
    tokens: jax.Array
    log_probs: jax.Array
    lengths: jax.Array
    running: jax.Array
    stop_state: jax.Array
    cache: KVCache


def _stopped(token, step, stop_state, config: SamplerConfig, stop: StopStrings | None):
    """Whether each row ends with ``token`` (its ``step``-th), and the advanced stop-string states."""
    ended = step + 1 >= config.max_new_tokens
    if config.stop_ids:
        ended = ended | jnp.isin(token, jnp.asarray(config.stop_ids, jnp.int32))
    if stop is not None:
        strings = jnp.arange(stop.transitions.shape[0])
        stop_state = stop.transitions[strings[None, :], stop_state, token[:, None]]
        ended = ended | jnp.any(stop_state >= stop.lengths[None, :], axis=-1)
    return ended, stop_state


# Cache slots a CPU call runs on are a multiple of this (one compiled branch per multiple).
CPU_CACHE_BLOCK = 256


def on_filled_slots(call: Callable[[KVCache], tuple[Any, KVCache]], cache: KVCache, new_tokens: int,
                    empty: bool = False) -> tuple[Any, KVCache]:
    """``call(cache) -> (out, cache)``, on the CPU given only the cache's first ``max(lengths) + new_tokens``
    slots rounded up to ``CPU_CACHE_BLOCK``, elsewhere the whole cache. ``empty`` (every length 0, known
    when tracing) makes the prefix static: one branch instead of one per multiple of ``CPU_CACHE_BLOCK``.

    A cached model call attends to every slot and reads each layer's whole slice, so on the CPU a turn's cost
    grows with the cache's size, not its filled length.
    The sampler runs a whole turn (prefill and decode loop) in one call, so the branch and its copy of the
    prefix happen once per turn. Unfilled slots are masked out of attention: the output is the whole cache's.
    """
    size = cache.max_length
    sizes = sorted({min(n, size) for n in range(CPU_CACHE_BLOCK, size + CPU_CACHE_BLOCK, CPU_CACHE_BLOCK)})

    def on_prefix(n: int):
        def run(cache: KVCache):
            out, part = call(KVCache(cache.keys[:, :, :, :n], cache.values[:, :, :, :n], cache.lengths))
            put = lambda full, new: jax.lax.dynamic_update_slice_in_dim(full, new, 0, axis=3)  # noqa: E731
            return out, KVCache(put(cache.keys, part.keys), put(cache.values, part.values), part.lengths)
        return run

    branches = [on_prefix(n) for n in sizes[:-1]] + [call]

    def on_cpu(cache: KVCache):
        needed = jnp.max(cache.lengths) + new_tokens
        branch = jnp.minimum(jnp.searchsorted(jnp.asarray(sizes), needed), len(sizes) - 1)
        return jax.lax.switch(branch, branches, cache)

    if empty:
        on_cpu = branches[min(int(np.searchsorted(sizes, new_tokens)), len(sizes) - 1)]

    return jax.lax.platform_dependent(cache, cpu=on_cpu, default=call)


def make_sampler(graphdef: nnx.GraphDef, config: SamplerConfig, stop: StopStrings | None = None,
                 mesh: Mesh | None = None, total_rows: int | None = None) -> Callable:
    """Compiles ``sample(params, tokens, mask, cache, key, active, rows=None) -> Sample``.

    With ``total_rows`` each call samples a slice of a ``total_rows``-row batch, ``rows`` its rows' indices in
    it, and draws as the whole batch would (``choose``).

    With ``mesh``, the cache is kept on ``cache_shardings`` (batch over the data axes,
    kv heads over ``tensor``) at every decode step instead of wherever propagation puts it.

    Args of the returned function:
      params: the model state (``nnx.split(model)[1]``).
      tokens, mask: ``[B, T]`` left-padded new segment (the prompt, or the next turn's text).
      cache: ``KVCache`` holding the earlier turns (lengths 0 for a fresh one); donated. It
        must have room for ``T + max_new_tokens`` more slots per row.
      key: PRNG key.
      active: ``[B]`` bool, rows that generate (others only append their segment).
      rows: ``[B]`` int32 indices of the rows in the whole batch (with ``total_rows``).
      empty: static; the cache holds nothing yet (a first turn), so ``on_filled_slots``'s prefix is static.
    """
    def placed(cache: KVCache) -> KVCache:
        return cache if mesh is None else jax.lax.with_sharding_constraint(cache, cache_shardings(cache, mesh))

    def generate(params: Any, tokens, mask, cache: KVCache, key, active, rows) -> tuple[tuple, KVCache]:
        model = nnx.merge(graphdef, params)
        slice_of = None if total_rows is None else (rows, total_rows)
        batch, n = tokens.shape[0], config.max_new_tokens
        hidden, cache = model.model(tokens, mask, cache)  # only the last position needs logits
        last = constrain(hidden[:, -1:], DECODE_RESIDUAL)[:, 0]  # as a decode step's: no gathered LM head
        cache = placed(cache)
        token, log_prob = choose(model.logits(last), jax.random.fold_in(key, 0), config, slice_of)
        num_strings = 0 if stop is None else stop.transitions.shape[0]
        ended, stop_state = _stopped(token, jnp.int32(0), jnp.zeros((batch, num_strings), jnp.int32), config, stop)
        state = _Loop(
            step=jnp.int32(1), token=token,
            tokens=jnp.full((batch, n), config.pad_id, jnp.int32).at[:, 0].set(jnp.where(active, token, config.pad_id)),
            log_probs=jnp.zeros((batch, n), jnp.float32).at[:, 0].set(jnp.where(active, log_prob, 0.0)),
            lengths=active.astype(jnp.int32), running=active & ~ended, stop_state=stop_state, cache=cache)

        def unfed(s: _Loop):
            return jnp.any(s.lengths >= s.step)

        def decode(s: _Loop) -> _Loop:
            feed = s.lengths >= s.step
            logits, cache = model(s.token[:, None], feed[:, None], s.cache)
            cache = placed(cache)
            token, log_prob = choose(logits[:, 0], jax.random.fold_in(key, s.step), config, slice_of)
            ended, stop_state = _stopped(token, s.step, s.stop_state, config, stop)
            column = jnp.minimum(s.step, n - 1)
            return _Loop(
                step=s.step + 1, token=jnp.where(s.running, token, s.token),
                tokens=s.tokens.at[:, column].set(jnp.where(s.running, token, s.tokens[:, column])),
                log_probs=s.log_probs.at[:, column].set(jnp.where(s.running, log_prob, s.log_probs[:, column])),
                lengths=s.lengths + s.running, running=s.running & ~ended,
                stop_state=jnp.where(s.running[:, None], stop_state, s.stop_state), cache=cache)

        final = jax.lax.while_loop(unfed, decode, state)
        return (final.tokens, final.log_probs, final.lengths), final.cache

    def sample(params: Any, tokens, mask, cache: KVCache, key, active, rows=None, empty: bool = False) -> Sample:
        if (rows is None) != (total_rows is None):
            raise ValueError(f"rows (the slice's row indices) are given exactly when total_rows is; total_rows="
                             f"{total_rows}, rows {'absent' if rows is None else 'given'}")
        run = lambda c: generate(params, tokens, mask, c, key, active, rows)  # noqa: E731
        out, cache = on_filled_slots(run, cache, tokens.shape[1] + config.max_new_tokens, empty)
        return Sample(*out, cache)

    return jax.jit(sample, donate_argnames="cache", static_argnames="empty")
