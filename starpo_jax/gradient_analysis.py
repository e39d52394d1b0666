"""RAGEN-2's gradient analysis: per-bucket gradient norms of each loss component, without a step (ragen2.md §5).

Groups of the training batch are bucketed by their pre-filter reward std r_g (``quantile``: ``num_buckets`` equal
shares, ``bucket_1`` lowest; ``fixed_rv``: r_g in [i − 1, i) for i = 1…5, ``bucket_6`` ≥ 5), plus ``all``. For each
bucket the actor's loss is split into its components — task (the policy-gradient term), entropy
(−``entropy_coeff``·H, when the coefficient is non-zero) and kl (``kl_loss_coef``·KL, with ``use_kl_loss``) — and
the global norm of each one's gradient is logged: the evidence that low-variance groups carry little task signal
while the regularisers' gradients stay. Each bucket is one aggregation unit (its loss aggregated over its rows);
RAGEN-2 aggregates per mini-batch of the bucket and divides by its training gradient accumulation.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from runtime.metrics import Table
from starpo_jax.losses import configured_actor_loss
from starpo_jax.steps import PolicyBatch, model_token_log_probs

FIXED_RV_EDGES = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0, math.inf)


def bucket_groups(group_std: np.ndarray, num_buckets: int, mode: str) -> dict[str, np.ndarray]:
    """Group ids per non-empty bucket (``RewardRolloutFilter.split_into_buckets``); ties go to the lower id."""
    if mode == "fixed_rv":
        buckets = [np.flatnonzero((group_std >= lo) & (group_std < hi))
                   for lo, hi in zip(FIXED_RV_EDGES[:-1], FIXED_RV_EDGES[1:])]
    else:
        count = min(num_buckets, len(group_std))
        order, size = np.argsort(group_std, kind="stable"), len(group_std) // count
        buckets = [order[i * size:(i + 1) * size if i < count - 1 else None] for i in range(count)]
    return {f"bucket_{i + 1}": np.sort(b) for i, b in enumerate(buckets) if len(b)}


def make_component_grad_norms(graphdef: nnx.GraphDef, actor: Any, temperature: float = 1.0) -> Callable:
    """``fn(trainable, frozen, PolicyBatch) -> metrics``: each component's gradient norm and loss, one bucket."""
    def components(params, frozen, batch: PolicyBatch):
        model = nnx.merge(graphdef, params, frozen)
        log_probs, entropy = model_token_log_probs(model, batch.input_ids, batch.attention_mask, temperature)
        out = configured_actor_loss(log_probs, entropy, batch, actor)
        terms = {}
        if actor.entropy_coeff != 0:
            terms["entropy"] = -actor.entropy_coeff * out.metrics["actor/entropy_loss"]
        if actor.use_kl_loss:
            terms["kl"] = actor.kl_loss_coef * out.metrics["actor/kl_loss"]
        return {"task": out.loss - sum(terms.values()), **terms}, out.loss

    def fn(params, frozen, batch: PolicyBatch) -> dict[str, jax.Array]:
        terms, vjp, total = jax.vjp(lambda p: components(p, frozen, batch), params, has_aux=True)
        metrics = {"loss/total": total, "loss/policy": terms["task"], "loss/entropy": terms.get("entropy", 0.0),
                   "loss/kl": terms.get("kl", 0.0)}
        for name in terms:
            cotangent = {k: jnp.asarray(k == name, v.dtype) for k, v in terms.items()}
            metrics[name] = optax.tree.norm(vjp(cotangent)[0])
        return metrics

    return jax.jit(fn)


def _buckets(group_ids: np.ndarray, reward_std: np.ndarray, num_buckets: int,
             mode: str) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """``(groups, r_g, {bucket: indices into groups})``: the batch's group ids, their RV and ``all`` + the buckets."""
    groups = np.unique(group_ids)
    group_std = np.array([reward_std[group_ids == g].mean() for g in groups])
    return groups, group_std, {"all": np.arange(len(groups)), **bucket_groups(group_std, num_buckets, mode)}


def gradient_analysis(grad_norms: Callable, params: Any, frozen: Any, batch: PolicyBatch, group_ids: np.ndarray,
                      reward_std: np.ndarray, num_buckets: int, mode: str,
                      prefix: str = "grad_norm") -> dict[str, float]:
    """RAGEN-2's ``{prefix}/{all,bucket_i}/*`` metrics of one batch, and (for ``grad_norm``) ``actor/grad_norm/*``,
    ``actor/loss/*`` of the whole batch (``gradient_reporter``); ``reward_std`` is each row's pre-filter group std."""
    groups, group_std, buckets = _buckets(group_ids, reward_std, num_buckets, mode)
    out: dict[str, float] = {}
    for name, members in buckets.items():
        rows = np.flatnonzero(np.isin(group_ids, groups[members]))
        part = jax.tree.map(lambda x: jnp.asarray(x)[rows], batch)
        metrics = {k: float(v) for k, v in jax.device_get(grad_norms(params, frozen, part)).items()}
        tokens = max(float(np.sum(np.asarray(batch.loss_mask)[rows])), 1.0)
        stats = {"sample_count": float(len(rows)), "sample_pct": len(rows) / len(group_ids),
                 "reward_std_mean": float(group_std[members].mean()), "reward_std_min": float(group_std[members].min()),
                 "reward_std_max": float(group_std[members].max()), "group_rv_count": float(len(members))}
        for component in ("task", "entropy", "kl"):
            if component in metrics:
                stats |= {f"per_sample/{component}": metrics[component] / len(rows),
                          f"per_token/{component}": metrics[component] / tokens}
        out |= {f"{prefix}/{name}/{k}": v for k, v in (metrics | stats).items()}
        if name == "all" and prefix == "grad_norm":
            out |= {f"actor/{'grad_norm/' if '/' not in k else ''}{k}": v for k, v in metrics.items()}
    return out


def group_rv_tables(group_ids: np.ndarray, reward_std: np.ndarray, num_buckets: int, mode: str,
                    prefix: str = "grad_norm") -> dict[str, Table]:
    """``{prefix}/{bucket}/group_rv_table``: one row ``(bucket, group_id, reward_std)`` per group of the bucket."""
    groups, group_std, buckets = _buckets(group_ids, reward_std, num_buckets, mode)
    return {f"{prefix}/{name}/group_rv_table": Table(("bucket", "group_id", "reward_std"), [
        (name, int(groups[i]), float(group_std[i])) for i in members]) for name, members in buckets.items()}
