"""The cross log-probability matrix of (prompt, reasoning) pairs as one compiled program (ragen2.md §3.6).

``L[i, j] = Σ_t log p(z_{i,t} | x_j, z_{i,<t})`` for every sampled reasoning ``z_i`` and prompt
``x_j``. RAGEN-2 scores the ``n · N`` sequences ``[x_j | z_i]`` one column at a time, each a full
teacher-forced pass. Here each column's prompt is run once into a KV cache that all ``n`` reasonings
share (the prompt's keys and values do not depend on the reasoning), so a column costs one prompt
pass plus ``n`` reasoning passes; the columns are a ``lax.map`` inside one ``jax.jit``, the reasoning
rows sharded over the mesh's data axes. Logits are divided by the rollout temperature before the
log-softmax, as verl's ``compute_log_prob`` does.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from runtime.mesh import batch_sharding
from starpo_jax.models.config import TransformerConfig
from starpo_jax.models.kv_cache import KVCache, cache_shardings, init_cache
from starpo_jax.steps import hidden_log_probs


def make_cross_log_probs(graphdef: nnx.GraphDef, config: TransformerConfig, temperature: float = 1.0,
                         mesh: Mesh | None = None) -> Callable:
    """Compiles ``cross(params, prompts, prompt_mask, reasonings, reasoning_mask) -> L_seq[n, N]``.

    Args of the returned function:
      params: the policy's state (``nnx.split(model)[1]``).
      prompts, prompt_mask: ``[N, P]`` left-padded prompt ids (each ends with the forced ``<think>``).
      reasonings, reasoning_mask: ``[n, T]`` right-padded reasoning ids.
    """
    def column(model, prompt, prompt_mask, reasonings, reasoning_mask):
        rows, length = reasonings.shape
        cache = init_cache(config, 1, prompt.shape[0] + length)
        hidden, cache = model.model(prompt[None], prompt_mask[None], cache)
        cache = KVCache(*(jnp.repeat(x, rows, axis=1) for x in cache[:2]), jnp.repeat(cache.lengths, rows))
        if mesh is not None:
            cache = jax.lax.with_sharding_constraint(cache, cache_shardings(cache, mesh))
        reasoning_hidden, _ = model.model(reasonings, reasoning_mask, cache)
        first = jnp.broadcast_to(hidden[:, -1:], (rows, 1, hidden.shape[-1]))  # predicts z_0
        states = jnp.concatenate([first, reasoning_hidden[:, :-1]], axis=1)
        log_probs, _ = hidden_log_probs(model, states, reasonings, temperature)
        return jnp.sum(jnp.where(reasoning_mask.astype(bool), log_probs, 0.0), axis=1)

    def rows(x: jax.Array) -> jax.Array:
        return x if mesh is None else jax.lax.with_sharding_constraint(x, batch_sharding(mesh, x.ndim))

    def cross(params: Any, prompts, prompt_mask, reasonings, reasoning_mask) -> jax.Array:
        model = nnx.merge(graphdef, params)
        reasonings, reasoning_mask = rows(reasonings), rows(reasoning_mask)
        per_column = jax.lax.map(lambda x: column(model, x[0], x[1], reasonings, reasoning_mask),
                                 (prompts, prompt_mask))
        return rows(per_column.T)

    return jax.jit(cross)
