"""Pure actor and critic steps, and the log-prob / value passes that feed them (starpo.md §9, §10).

A model is split once into a graph definition, its trainable variables (all
parameters, or only the LoRA adapters) and the frozen rest. Each step is
``step(state, frozen, batch) -> (state, metrics)``: micro-batches are
accumulated inside the compiled step (``runtime.train_state.scan_micro_batches``), each divided by the
whole mini-batch's ``loss_normalizer`` so the result does not depend on the
micro-batch size (starpo.md §22.5), gradients are clipped
by global norm, and an update with non-finite gradients is skipped and counted
(``runtime.guards.skip_non_finite``). Compile with ``runtime.train_state.compile_step``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from runtime.guards import non_finite_metrics, skip_non_finite
from runtime.train_state import TrainState, scan_micro_batches
from starpo_jax.config import ActorConfig, CriticConfig, OptimConfig
from starpo_jax.losses import CRITIC_LOSSES, configured_actor_loss, entropy_from_logits, loss_normalizer

# Loss terms whose micro-batch values add up to the mini-batch value; other metrics are averaged.
SUMMED_METRICS = ("actor/pg_loss", "actor/entropy_loss", "actor/kl_loss", "critic/vf_loss")


class PolicyBatch(NamedTuple):
    """One actor mini-batch; per-position arrays are ``[B, L − 1]`` (position j scores token j + 1)."""

    input_ids: jax.Array
    attention_mask: jax.Array
    loss_mask: jax.Array
    old_log_probs: jax.Array
    advantages: jax.Array
    ref_log_probs: jax.Array


class CriticBatch(NamedTuple):
    """One critic mini-batch; the value at token j is used for position j (``[B, L − 1]``)."""

    input_ids: jax.Array
    attention_mask: jax.Array
    loss_mask: jax.Array
    old_values: jax.Array
    returns: jax.Array


def split_trainable(model: nnx.Module, lora: bool) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """``(graphdef, trainable, frozen)``: LoRA adapters only, or every parameter."""
    return nnx.split(model, nnx.LoRAParam if lora else nnx.Param, ...)


def learning_rate(optim: OptimConfig, total_steps: int = 1, updates_per_step: int = 1) -> float | optax.Schedule:
    """``optim.lr``, or verl's warmup schedule over training iterations as an optax schedule.

    Iteration ``s`` (the optimizer count // ``updates_per_step``: every mini-batch of every epoch is one
    update) has ``lr × f(s)``; with ``W`` warmup iterations (``lr_warmup_steps``, or when negative
    ``int(lr_warmup_steps_ratio × total_steps)``), ``constant``: ``f = min(1, s / W)``; ``cosine``:
    ``s / W`` before ``W``, then ``max(0, (1 + m) / 2 + (1 − m) / 2 · cos(2π · num_cycles · p))`` with
    ``p = (s − W) / max(1, total_steps − W)`` and ``m = min_lr_ratio``. Without warmup a ``constant``
    learning rate is the plain float (verl's lambda would give 0 at iteration 0 even then).
    """
    warmup = optim.lr_warmup_steps if optim.lr_warmup_steps >= 0 else int(optim.lr_warmup_steps_ratio * total_steps)
    if optim.warmup_style == "constant" and warmup == 0:
        return optim.lr

    def schedule(count):
        step = (count // updates_per_step).astype(jnp.float32)
        ramp = step / max(1, warmup)
        if optim.warmup_style == "constant":
            return optim.lr * jnp.minimum(1.0, ramp)
        progress = (step - warmup) / max(1, total_steps - warmup)
        cosine = (1 + optim.min_lr_ratio) / 2 + (1 - optim.min_lr_ratio) / 2 * jnp.cos(
            2 * jnp.pi * optim.num_cycles * progress)
        return optim.lr * jnp.where(step < warmup, ramp, jnp.maximum(0.0, cosine))

    return schedule


def make_optimizer(optim: OptimConfig, grad_clip: float, total_steps: int = 1,
                   updates_per_step: int = 1) -> optax.GradientTransformation:
    """AdamW at ``learning_rate(optim, ...)`` after global-norm clipping; non-finite updates skipped."""
    return skip_non_finite(optax.chain(
        optax.clip_by_global_norm(grad_clip),
        optax.adamw(learning_rate(optim, total_steps, updates_per_step), b1=optim.betas[0], b2=optim.betas[1],
                    eps=1e-8, weight_decay=optim.weight_decay)))


# Positions whose vocabulary logits exist at once in ``model_token_log_probs``.
LOG_PROB_CHUNK = 256


def _target_log_probs(logits: jax.Array, targets: jax.Array, temperature: float) -> tuple[jax.Array, jax.Array]:
    """Log-probabilities of ``targets`` and entropies under ``softmax(logits / T)`` (aligned positions)."""
    scaled = logits.astype(jnp.float32) / temperature
    # z[target] - logsumexp(z) = log_softmax(z)[target] without the [..., vocab] log-softmax and its gather's
    # scatter in the backward (1.2x faster forward + backward on XLA:CPU, bench/README.md).
    log_probs = jnp.take_along_axis(scaled, targets[..., None], axis=-1)[..., 0] - jax.nn.logsumexp(scaled, axis=-1)
    return log_probs, entropy_from_logits(scaled)


def token_log_probs(logits: jax.Array, input_ids: jax.Array, temperature: float) -> tuple[jax.Array, jax.Array]:
    """Log-probabilities and entropies of tokens 1..L−1 under ``softmax(logits / T)``, each ``[B, L − 1]``."""
    return _target_log_probs(logits[:, :-1], input_ids[:, 1:], temperature)


def model_token_log_probs(model: nnx.Module, input_ids: jax.Array, attention_mask: jax.Array, temperature: float,
                          chunk: int = LOG_PROB_CHUNK) -> tuple[jax.Array, jax.Array]:
    """``token_log_probs(model(input_ids, attention_mask)[0], ...)`` without the ``[B, L, vocab]`` float32 logits."""
    hidden, _ = model.model(input_ids, attention_mask)
    return hidden_log_probs(model, hidden[:, :-1], input_ids[:, 1:], temperature, chunk)


def hidden_log_probs(model: nnx.Module, hidden: jax.Array, targets: jax.Array, temperature: float,
                     chunk: int = LOG_PROB_CHUNK) -> tuple[jax.Array, jax.Array]:
    """Log-probabilities of ``targets[B, n]`` and entropies under the LM head applied to ``hidden[B, n, E]``.

    The LM head and log-softmax run on ``chunk`` positions at a time (``lax.scan``), each chunk
    rematerialised in the backward pass, so only ``[B, chunk, vocab]`` logits are ever live. The loop is
    unrolled when the model's ``scan_layers`` is off (``launch.compile``'s loop-free cost copies).
    """
    n = targets.shape[1]
    if n <= chunk:
        return _target_log_probs(model.logits(hidden), targets, temperature)
    pad = -n % chunk

    def chunks(x):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.swapaxes(x.reshape(x.shape[0], -1, chunk, *x.shape[2:]), 0, 1)

    one = jax.checkpoint(lambda xs: _target_log_probs(model.logits(xs[0]), xs[1], temperature))
    _, out = jax.lax.scan(lambda _, xs: (None, one(xs)), None, (chunks(hidden), chunks(targets)),
                          unroll=not model.config.scan_layers)
    return tuple(jnp.swapaxes(x, 0, 1).reshape(x.shape[1], -1)[:, :n] for x in out)


def micro_batches(batch: Any, num_micro_batches: int) -> Any:
    """Splits the leading axis into ``[num_micro_batches, B / num_micro_batches, ...]``.

    Micro-batch k takes rows k, k + n, k + 2n, …, so a batch sharded over devices by
    contiguous rows stays spread over all devices in every micro-batch.
    """
    def split(x):
        if x.shape[0] % num_micro_batches:
            raise ValueError(f"batch of {x.shape[0]} rows does not split into {num_micro_batches} micro-batches")
        return jnp.swapaxes(x.reshape(x.shape[0] // num_micro_batches, num_micro_batches, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)


def _accumulated_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, num_micro_batches: int,
                      loss_fn: Callable, prefix: str, lr: float | optax.Schedule, loss_agg_mode: str) -> Callable:
    """A step that sums ``loss_fn(model, micro_batch, normalizer) -> (loss, metrics)`` over micro-batches.

    ``lr`` (``learning_rate``'s value) is reported as ``{prefix}/lr``, a schedule at the step counter.
    """
    def step(state: TrainState, frozen: nnx.State, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        normalizer = loss_normalizer(batch.loss_mask, loss_agg_mode)

        def micro_loss(params, micro):
            return loss_fn(nnx.merge(graphdef, params, frozen), micro, normalizer)

        def accumulate(grads, micro):
            (_, metrics), micro_grads = jax.value_and_grad(micro_loss, has_aux=True)(state.params, micro)
            return jax.tree.map(jnp.add, grads, micro_grads), metrics

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        grads, metrics = scan_micro_batches(accumulate, zeros, micro_batches(batch, num_micro_batches))
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        metrics = {name: (jnp.sum if name in SUMMED_METRICS else jnp.mean)(value) for name, value in metrics.items()}
        metrics[f"{prefix}/grad_norm"] = optax.tree.norm(grads)
        metrics[f"{prefix}/lr"] = jnp.asarray(lr(state.step) if callable(lr) else lr, jnp.float32)
        metrics.update({f"{prefix}/{name.split('/')[1]}": value for name, value in non_finite_metrics(opt_state).items()})
        params = optax.apply_updates(state.params, updates)
        return TrainState(params, opt_state, state.step + 1, state.rng), metrics

    return step


def make_actor_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, actor: ActorConfig,
                    num_micro_batches: int, temperature: float = 1.0,
                    lr: float | optax.Schedule | None = None) -> Callable:
    """``step(state, frozen, PolicyBatch)``: one optimiser step of the StarPO policy loss (starpo.md §10).

    ``lr``: ``tx``'s learning rate for the metric (default ``actor.optim.lr``).
    """
    def loss_fn(model, micro: PolicyBatch, normalizer):
        log_probs, entropy = model_token_log_probs(model, micro.input_ids, micro.attention_mask, temperature)
        out = configured_actor_loss(log_probs, entropy, micro, actor, normalizer)
        return out.loss, out.metrics

    return _accumulated_step(graphdef, tx, num_micro_batches, loss_fn, "actor", actor.optim.lr if lr is None else lr,
                             actor.loss_agg_mode)


def make_critic_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, critic: CriticConfig,
                     num_micro_batches: int, lr: float | optax.Schedule | None = None) -> Callable:
    """``step(state, frozen, CriticBatch)``: one optimiser step of ``critic.loss_mode``'s loss (starpo.md §10)."""
    def loss_fn(model, micro: CriticBatch, normalizer):
        values, _ = model(micro.input_ids, micro.attention_mask)
        out = CRITIC_LOSSES.get(critic.loss_mode)(values[:, :-1], micro.old_values, micro.returns, micro.loss_mask,
                                                  critic.cliprange_value, critic.loss_agg_mode, normalizer)
        return out.loss, out.metrics

    return _accumulated_step(graphdef, tx, num_micro_batches, loss_fn, "critic",
                             critic.optim.lr if lr is None else lr, critic.loss_agg_mode)


def make_log_prob_fn(graphdef: nnx.GraphDef, num_micro_batches: int, temperature: float = 1.0,
                     with_entropy: bool = False) -> Callable:
    """``fn(trainable, frozen, input_ids, attention_mask) -> log_probs [B, L − 1]``, micro-batched.

    Old log-probs are recomputed with the training parameters (starpo.md §9 step 4). Reference
    log-probs are the same pass with the LoRA adapters zeroed (the base model exactly)
    or with a frozen copy of the initial parameters. ``with_entropy``: ``(log_probs, entropies)``, the
    per-token entropies from the same chunked vocabulary pass (RAGEN-2's entropy filters).
    """
    def fn(trainable, frozen, input_ids, attention_mask):
        model = nnx.merge(graphdef, trainable, frozen)

        def one(micro):
            ids, mask = micro
            out = model_token_log_probs(model, ids, mask, temperature)
            return out if with_entropy else out[0]

        out = jax.lax.map(one, micro_batches((input_ids, attention_mask), num_micro_batches))
        return jax.tree.map(_merge_micro_batches, out)

    return fn


def make_value_fn(graphdef: nnx.GraphDef, num_micro_batches: int) -> Callable:
    """``fn(trainable, frozen, input_ids, attention_mask) -> values [B, L − 1]`` of the critic."""
    def fn(trainable, frozen, input_ids, attention_mask):
        model = nnx.merge(graphdef, trainable, frozen)
        out = jax.lax.map(lambda micro: model(*micro)[0][:, :-1],
                          micro_batches((input_ids, attention_mask), num_micro_batches))
        return _merge_micro_batches(out)

    return fn


def _merge_micro_batches(x: jax.Array) -> jax.Array:
    """Inverse of ``micro_batches`` for one array."""
    return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])
