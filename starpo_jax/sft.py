"""Supervised warm-up: next-token cross-entropy on the assistant turns of demonstrations.

Demonstrations are packed exactly like rollouts (``starpo_jax.rollout.pack_trajectory``),
so the supervised tokens are the ones StarPO later trains: the positions of the
trajectory's ``loss_mask`` (starpo.md §7). The loss is the token mean of
``−log π(token_{j+1} | tokens_{≤j})`` over those positions; one step is a pure
function compiled with ``runtime.train_state.compile_step`` (AdamW after global-norm
clipping, learning rate decayed to zero on a cosine, so the last batches do not
decide between equally demonstrated actions).
"""

from __future__ import annotations

from typing import Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from runtime.mesh import batch_sharding
from runtime.metrics import MetricWriter, ProgressBar
from runtime.sharding import shardings_of
from runtime.train_state import TrainState, compile_step, init_train_state
from starpo_jax.losses import aggregate_loss
from starpo_jax.masked import masked_mean
from starpo_jax.steps import split_trainable, token_log_probs
from starpo_jax.trajectory import Trajectory


class SFTBatch(NamedTuple):
    """Token ids and attention mask ``[B, L]``, loss mask ``[B, L − 1]`` (position j predicts token j + 1)."""

    input_ids: jax.Array
    attention_mask: jax.Array
    loss_mask: jax.Array


def sft_loss(logits: jax.Array, batch: SFTBatch) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Token-mean negative log-likelihood over the loss mask, and the next-token accuracy."""
    log_probs, _ = token_log_probs(logits, batch.input_ids, 1.0)
    loss = aggregate_loss(-log_probs, batch.loss_mask, "token-mean")
    correct = (jnp.argmax(logits[:, :-1], axis=-1) == batch.input_ids[:, 1:]).astype(jnp.float32)
    return loss, {"sft/loss": loss, "sft/accuracy": masked_mean(correct, batch.loss_mask)}


def make_sft_step(graphdef: nnx.GraphDef, tx) -> Callable:
    """``step(state, frozen, SFTBatch) -> (state, metrics)``: one optimiser step of ``sft_loss``."""
    def step(state: TrainState, frozen: nnx.State, batch: SFTBatch):
        def loss_fn(params):
            logits, _ = nnx.merge(graphdef, params, frozen)(batch.input_ids, batch.attention_mask)
            return sft_loss(logits, batch)

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        metrics["sft/grad_norm"] = optax.tree.norm(grads)
        return TrainState(optax.apply_updates(state.params, updates), opt_state, state.step + 1, state.rng), metrics

    return step


def epoch_batches(demos: Trajectory, batch_size: int, rng: np.random.Generator, bucket: int = 1,
                  window: int = 16) -> Iterator[SFTBatch]:
    """Shuffled mini-batches of ``batch_size`` rows, repeating the demonstrations without end.

    Rows of similar length share a batch (``group_by_length`` of HF's Trainer): each epoch's
    shuffled rows are sorted by length within windows of ``window`` batches, the batches are
    shuffled, and each is cut to its longest row rounded up to ``bucket`` (the rows are left
    padded, so only padding is cut and positions do not change). Short demonstrations then do
    not pay for the longest one; at most ``width / bucket`` batch shapes are compiled.
    """
    rows, width = demos.input_ids.shape
    if rows < batch_size:
        raise ValueError(f"{rows} demonstrations are fewer than the SFT batch size {batch_size}")
    if bucket < 1 or window < 1:
        raise ValueError(f"bucket and window must be >= 1, got bucket={bucket}, window={window}")
    lengths = np.asarray(demos.attention_mask).sum(axis=1)
    while True:
        order = rng.permutation(rows)[:rows - rows % batch_size]
        groups = [chunk[np.argsort(-lengths[chunk], kind="stable")]
                  for chunk in np.split(order, range(batch_size * window, len(order), batch_size * window))]
        batches = np.concatenate(groups).reshape(-1, batch_size)
        for take in batches[rng.permutation(len(batches))]:
            keep = min(width, -(-int(lengths[take].max()) // bucket) * bucket)
            yield SFTBatch(demos.input_ids[take, width - keep:], demos.attention_mask[take, width - keep:],
                           demos.loss_mask[take, width - keep:])


def fit(model: nnx.Module, demos: Trajectory, mesh: Mesh, *, steps: int, batch_size: int, lr: float,
        bucket: int = 64, seed: int = 0, writer: MetricWriter | None = None) -> nnx.Module:
    """Trains every parameter of ``model`` for ``steps`` mini-batches of ``demos`` (peak learning rate
    ``lr``; batches grouped by length, their widths multiples of ``bucket``); returns the model.

    Metrics ``sft/{loss,accuracy,grad_norm}`` go to ``writer`` every step; a progress bar shows them.
    """
    graphdef, params, frozen = split_trainable(model, lora=False)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(optax.cosine_decay_schedule(lr, steps), weight_decay=0.01))
    state = init_train_state(params, tx, jax.random.key(seed), mesh)
    step = compile_step(make_sft_step(graphdef, tx), state, shardings_of(frozen), batch_sharding(mesh, 2))
    batches = epoch_batches(demos, batch_size, np.random.default_rng(seed), bucket)
    with ProgressBar(steps, "SFT", keys=("sft/loss", "sft/accuracy")) as bar:
        for i in range(steps):
            state, metrics = step(state, frozen, jax.device_put(next(batches), batch_sharding(mesh, 2)))
            if writer is not None:
                metrics = writer.write(i + 1, metrics)
            bar.update(i + 1, {k: float(v) for k, v in metrics.items()})
    return nnx.merge(graphdef, state.params, frozen)
