"""One StarPO update from a rollout, composed from the pure pieces (starpo.md §9).

normalise scores → filter groups by reward std → old / reference log-probs and
values → token rewards (KL-in-reward optional) → advantages → critic steps →
actor steps, one optimiser step per mini-batch. The algorithm (PPO or GRPO,
StarPO or StarPO-S) is only the config; nothing here branches on its name.
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from runtime.mesh import batch_sharding
from runtime.metrics import Table
from runtime.sharding import shardings_of
from runtime.train_state import TrainState, compile_step, init_train_state
from starpo_jax.advantages import AdvantageInputs, apply_kl_penalty, compute_advantage, scale_advantages
from starpo_jax.analysis_rollout import analysis_config, keep_all_config
from starpo_jax.config import StarPOConfig
from starpo_jax.episodes import Episodes
from starpo_jax.filtering import num_kept_groups
from starpo_jax.gradient_analysis import gradient_analysis, group_rv_tables, make_component_grad_norms
from starpo_jax.group_filters import ROLLOUT_FILTERS, FilterInputs
from starpo_jax.masked import masked_mean
from starpo_jax.scores import normalization_group_ids, normalize_scores, place_scores_on_last_token
from starpo_jax.snr_filter import STRATEGIES, canonical_metric
from starpo_jax.steps import (CriticBatch, PolicyBatch, learning_rate, make_actor_step, make_critic_step,
                              make_log_prob_fn, make_optimizer, make_value_fn, split_trainable)
from starpo_jax.trajectory import Trajectory


# Running counts of skipped optimizer steps: an iteration reports the count after its last mini-batch.
NON_FINITE_COUNTERS = ("/non_finite_steps", "/consecutive_non_finite")


class Learner(NamedTuple):
    """The compiled functions and frozen parts one update needs (built by the launch script).

    ``actor_step`` / ``critic_step``: ``(state, frozen, batch) -> (state, metrics)``;
    ``log_probs`` / ``values``: ``(trainable, frozen, ids, mask) -> [B, L − 1]``;
    ``reference``: trainable variables giving the reference policy (LoRA zeroed, or the
    initial parameters), or ``None`` when no KL term needs it. ``grad_norms``: the gradient analysis's per-component
    function (``trainer.gradient_analysis_mode``). ``entropies``: ``make_log_prob_fn(..., with_entropy=True)`` over
    ``entropies_micro_batches`` micro-batches, for RAGEN-2's entropy filter metrics (else ``None``).
    """

    actor_step: Callable
    critic_step: Callable | None
    log_probs: Callable
    values: Callable | None
    actor_frozen: Any
    critic_frozen: Any
    reference: Any
    grad_norms: Callable | None = None
    entropies: Callable | None = None
    entropies_micro_batches: int = 1


def num_micro_batches(config: StarPOConfig, mesh: Mesh, section: str = "actor_rollout_ref.actor") -> int:
    """Micro-batches per mini-batch of ``section`` (the actor or ``critic``): ``ppo_micro_batch_size_per_gpu``
    rows on each data-parallel device (both follow the top-level keys unless set)."""
    data_parallel = mesh.shape["data"] * mesh.shape["fsdp"]
    mini, micro = _batch_sizes(config, section)
    if mini % (micro * data_parallel):
        raise ValueError(f"ppo_mini_batch_size={mini} must be a multiple of micro_batch_size_per_gpu={micro} x "
                         f"{data_parallel} data-parallel devices (mesh data x fsdp), in {section} (its "
                         f"ppo_mini_batch_size and ppo_micro_batch_size_per_gpu follow those two unless set)")
    return mini // (micro * data_parallel)


def _batch_sizes(config: StarPOConfig, section: str) -> tuple[int, int]:
    """``(ppo_mini_batch_size, ppo_micro_batch_size_per_gpu)`` of ``section``, following the top-level keys."""
    part = config.critic if section == "critic" else config.actor_rollout_ref.actor
    mini, micro = part.ppo_mini_batch_size, part.ppo_micro_batch_size_per_gpu
    return (config.ppo_mini_batch_size if mini is None else mini,
            config.micro_batch_size_per_gpu if micro is None else micro)


def updates_per_iteration(config: StarPOConfig, section: str) -> int:
    """Optimizer steps of ``section`` per iteration: ``ppo_epochs`` × mini-batches of the filtered batch."""
    groups = config.es_manager.train
    kept = groups.env_groups * groups.group_size  # an adaptive filter's most (config_checks refuses schedules then)
    if config.actor_rollout_ref.rollout.rollout_filter_strategy == "starpo_s":
        kept = num_kept_groups(groups.env_groups, config.actor_rollout_ref.rollout.rollout_filter_ratio) * groups.group_size
    epochs = (config.critic if section == "critic" else config.actor_rollout_ref.actor).ppo_epochs
    return epochs * max(1, kept // _batch_sizes(config, section)[0])


def _optimizer(config: StarPOConfig, section: str) -> tuple[Any, Any]:
    """``(tx, lr)`` of ``section``: its AdamW and learning rate (or schedule) over the run's iterations."""
    part = config.critic if section == "critic" else config.actor_rollout_ref.actor
    total, per_step = config.trainer.total_training_steps, updates_per_iteration(config, section)
    return (make_optimizer(part.optim, part.grad_clip, total, per_step),
            learning_rate(part.optim, total, per_step))


def build_learner(config: StarPOConfig, policy: nnx.Module, critic: nnx.Module | None,
                  mesh: Mesh) -> tuple[Learner, TrainState, TrainState | None, nnx.GraphDef]:
    """Optimisers, train states and compiled steps for a placed policy (and critic, for GAE).

    Returns the learner, the actor and critic states, and the policy's graph definition
    (for the sampler). Only LoRA adapters train when ``config.lora.rank > 0``; the actor and the critic
    each use their own mini- and micro-batch sizes.
    """
    micro_batches = num_micro_batches(config, mesh)
    lora = config.lora.rank > 0
    actor_cfg, critic_cfg = config.actor_rollout_ref.actor, config.critic
    temperature = config.actor_rollout_ref.rollout.temperature
    rows = batch_sharding(mesh, 2)
    graphdef, trainable, frozen = split_trainable(policy, lora)
    reference = jax.tree.map(jnp.zeros_like if lora else jnp.copy, trainable) if config.needs_ref_log_prob else None
    actor_tx, actor_lr = _optimizer(config, "actor_rollout_ref.actor")
    actor = init_train_state(trainable, actor_tx, jax.random.key(config.seed.train), mesh)
    critic_state = critic_step = values = critic_frozen = None
    if critic is not None:
        critic_graphdef, critic_trainable, critic_frozen = split_trainable(critic, lora)
        critic_tx, critic_lr = _optimizer(config, "critic")
        critic_micro = num_micro_batches(config, mesh, "critic")
        critic_state = init_train_state(critic_trainable, critic_tx, jax.random.key(config.seed.train + 1), mesh)
        critic_step = compile_step(make_critic_step(critic_graphdef, critic_tx, critic_cfg, critic_micro, critic_lr),
                                   critic_state, shardings_of(critic_frozen), rows)
        values = jax.jit(make_value_fn(critic_graphdef, critic_micro))
    learner = Learner(
        actor_step=compile_step(make_actor_step(graphdef, actor_tx, actor_cfg, micro_batches, temperature, actor_lr),
                                actor, shardings_of(frozen), rows),
        critic_step=critic_step, log_probs=jax.jit(make_log_prob_fn(graphdef, micro_batches, temperature)),
        values=values, actor_frozen=frozen, critic_frozen=critic_frozen, reference=reference,
        grad_norms=make_component_grad_norms(graphdef, actor_cfg, temperature)
        if config.trainer.gradient_analysis_mode else None,
        entropies=jax.jit(make_log_prob_fn(graphdef, micro_batches, temperature, with_entropy=True))
        if filters_on_entropy(config) else None, entropies_micro_batches=micro_batches)
    return learner, actor, critic_state, graphdef


def filters_on_entropy(config: StarPOConfig) -> bool:
    """Whether an SNR filter ranks groups by the policy's token entropy (``rollout_filter_metric`` entropy*)."""
    rollout = config.actor_rollout_ref.rollout
    return rollout.rollout_filter_strategy in STRATEGIES and canonical_metric(rollout.rollout_filter_metric) in (
        "entropy", "entropy_variance")


def select_groups(traj: Trajectory, config: StarPOConfig, num_tags: int, step: int = 0,
                  entropies: np.ndarray | None = None) -> tuple[Trajectory, jax.Array, dict, np.ndarray]:
    """Normalised scores on the full batch, then the ``rollout_filter_strategy`` filter (starpo.md §11, ragen2.md §4).

    Returns the kept rows (group-major; RAGEN-2's batch adjustment may repeat rows), their normalised scores,
    the filter metrics and each row's pre-filter group reward std; an SNR filter may keep no row. StarPO-S ranks ``score + penalty`` before
    normalisation (starpo.md §22.12), RAGEN-2's filter the normalised reward; with ``agent_proxy.use_turn_scores``
    both rank each row's summed turn rewards as placed on the tokens (RAGEN ``original_rm_scores.sum(-1)``: no
    penalty, no normalisation). Per-turn samples (``traj.episode_ids``) are normalised and ranked per episode.
    ``entropies``: each row's mean token entropy (``filter_entropies``), which the entropy metrics rank.
    """
    groups = config.es_manager.train
    norm = config.agent_proxy.reward_normalization
    group_ids = normalization_group_ids(norm.grouping, jnp.asarray(traj.group_ids), jnp.asarray(traj.tag_ids))
    num_groups = groups.env_groups if norm.grouping != "inductive" else num_tags
    normalized = normalized_episode_scores(traj, group_ids, max(num_groups, 1), norm.method)
    if config.agent_proxy.use_turn_scores:
        raw = np.sum(np.asarray(traj.turn_rewards), axis=1)
    else:
        raw = np.asarray(traj.scores) + np.asarray(traj.penalty)
    inputs = FilterInputs(raw, np.asarray(normalized), np.sum(np.asarray(traj.loss_mask), axis=1), traj.episode_ids,
                          entropies)
    kept = ROLLOUT_FILTERS.get(config.actor_rollout_ref.rollout.rollout_filter_strategy)(inputs, config, step)
    rows = np.asarray(kept.rows, np.int64)
    selected = Trajectory(*(None if x is None else np.asarray(x)[rows] for x in traj))
    selected = selected._replace(loss_mask=selected.loss_mask * np.asarray(kept.sample_mask)[:, None])
    return selected, normalized[rows], kept.metrics, kept.reward_std


def normalized_episode_scores(traj: Trajectory, group_ids: jax.Array, num_groups: int, method: str) -> jax.Array:
    """``normalize_scores`` per trajectory; per-turn samples (``episode_ids``) normalise their episodes' scores,
    each counted once, and every turn-sample gets its episode's (RAGEN-2 ``_normalize_episode_rewards``)."""
    if traj.episode_ids is None:
        return normalize_scores(traj.scores, traj.penalty, group_ids, num_groups, method)
    episodes = Episodes(traj.episode_ids, len(traj.scores))
    first = episodes.first
    per_episode = normalize_scores(np.asarray(traj.scores)[first], np.asarray(traj.penalty)[first],
                                   jnp.asarray(group_ids)[first], num_groups, method)
    return jnp.asarray(episodes.broadcast(per_episode))


def _collect(rows: list[dict]) -> dict[str, list]:
    collected: dict[str, list] = {}
    for row in rows:
        for name, value in row.items():
            collected.setdefault(name, []).append(value)
    return collected


def run_epochs(step: Callable, state: TrainState, frozen: Any, batch: Any, mini_batch_size: int, epochs: int,
               shuffle_key: jax.Array | None, sharding: Any) -> tuple[TrainState, list[dict]]:
    """``epochs`` passes of ``step`` over the ``mini_batch_size``-row mini-batches of ``batch`` (purejaxrl's
    ``_update_epoch``); returns the state and each step's metrics.

    With ``shuffle_key``, epoch e takes the rows in the order ``permutation(fold_in(shuffle_key, e))``, gathered
    on device. Steps are dispatched without waiting for their results: no host round trip per mini-batch.
    """
    rows = jax.tree.leaves(batch)[0].shape[0]
    metrics: list[dict] = []
    for epoch in range(epochs):
        ordered = batch
        if shuffle_key is not None:
            order = jax.random.permutation(jax.random.fold_in(shuffle_key, epoch), rows)
            ordered = jax.tree.map(lambda x: jnp.asarray(x)[order], batch)
        for start in range(0, rows, mini_batch_size):
            mini = jax.tree.map(lambda x: x[start:start + mini_batch_size], ordered)
            state, m = step(state, frozen, jax.device_put(mini, sharding))
            metrics.append(m)
    return state, metrics


def filter_entropies(learner: Learner, actor: TrainState, traj: Trajectory,
                     config: StarPOConfig) -> np.ndarray | None:
    """Each trajectory's mean token entropy Σ(H·loss_mask) / max(Σ loss_mask, 1) under the current policy, when
    ``config``'s filter ranks by entropy (RAGEN-2's extra log-prob pass over the whole batch, ragen2.md §4.3)."""
    if not filters_on_entropy(config):
        return None
    if learner.entropies is None:
        raise ValueError("rollout_filter_metric ranks by entropy: build the learner with that config")
    ids, mask = (np.asarray(x) for x in (traj.input_ids, traj.attention_mask))
    pad = -len(ids) % learner.entropies_micro_batches  # the pass splits rows into whole micro-batches
    padded = [np.concatenate([x, np.repeat(x[-1:], pad, axis=0)]) for x in (ids, mask)]
    entropy = np.asarray(learner.entropies(actor.params, learner.actor_frozen, *padded)[1])[:len(ids)]
    loss_mask = np.asarray(traj.loss_mask, np.float32)
    return np.sum(entropy * loss_mask, axis=1) / np.maximum(np.sum(loss_mask, axis=1), 1.0)


class Prepared(NamedTuple):
    """A filtered batch ready to train: the actor's batch, the critic's values and returns, and its metrics."""

    policy: PolicyBatch
    values: jax.Array | None
    returns: jax.Array
    metrics: dict


def prepare_batch(actor: TrainState, critic: TrainState | None, learner: Learner, batch: Trajectory,
                  normalized: jax.Array, config: StarPOConfig, kept_ratio: float) -> Prepared:
    """Old and reference log-probs, values, token rewards (KL-in-reward optional), advantages and their scaling
    (``kept_ratio``: the filter's, for ``filter_loss_scaling``) of a filtered batch; ``timing_s/old_log_prob``."""
    clock = time.perf_counter()
    metrics: dict = {}
    ids, mask, loss_mask = (jnp.asarray(x) for x in (batch.input_ids, batch.attention_mask, batch.loss_mask))
    old_log_probs = learner.log_probs(actor.params, learner.actor_frozen, ids, mask)
    metrics["timing_s/old_log_prob"] = time.perf_counter() - clock
    ref_log_probs = jnp.zeros_like(old_log_probs)
    if learner.reference is not None:
        ref_log_probs = learner.log_probs(learner.reference, learner.actor_frozen, ids, mask)
        metrics["rollout/ref_log_prob"] = masked_mean(ref_log_probs, loss_mask)
    metrics["rollout/old_log_prob"] = masked_mean(old_log_probs, loss_mask)
    if batch.rollout_log_probs is not None:  # trained tokens sampled in the same context: the PPO ratio's denominator
        sampled = jnp.isfinite(batch.rollout_log_probs) & (loss_mask > 0)
        metrics["rollout/sampled_token_fraction"] = jnp.sum(sampled) / jnp.maximum(jnp.sum(loss_mask > 0), 1)
        metrics["rollout/sampler_log_prob_diff_max"] = jnp.max(jnp.where(
            sampled, jnp.abs(old_log_probs - jnp.nan_to_num(jnp.asarray(batch.rollout_log_probs))), 0.0))
    values = None
    if critic is not None:
        values = learner.values(critic.params, learner.critic_frozen, ids, mask) * loss_mask

    if config.agent_proxy.use_turn_scores:  # HEAD: per-turn rewards, unnormalised, so no format penalty (starpo.md §7)
        rewards = jnp.asarray(batch.turn_rewards)
    else:
        rewards = place_scores_on_last_token(normalized, loss_mask.shape[1])
    metrics["critic/score/mean"] = jnp.mean(jnp.sum(rewards, axis=1))
    algorithm = config.algorithm
    if algorithm.use_kl_in_reward:
        out = apply_kl_penalty(rewards, old_log_probs, ref_log_probs, loss_mask, algorithm.kl_ctrl.kl_coef,
                               algorithm.kl_penalty)
        rewards, metrics = out.token_level_rewards, {**metrics, **out.metrics}
    episode_ids = None if batch.episode_ids is None else jnp.asarray(batch.episode_ids)
    adv = compute_advantage(AdvantageInputs(rewards, values, loss_mask, jnp.asarray(batch.group_ids), old_log_probs,
                                            ref_log_probs, episode_ids), config)
    adv, scaling = scale_advantages(adv, rewards, jnp.asarray(batch.group_ids), config, kept_ratio, episode_ids)
    metrics |= scaling
    metrics.update({"critic/advantages/mean": masked_mean(adv.advantages, loss_mask),
                    "critic/returns/mean": masked_mean(adv.returns, loss_mask),
                    "response_length/mean": jnp.mean(jnp.sum(loss_mask, axis=1))})
    policy = PolicyBatch(ids, mask, loss_mask, old_log_probs, adv.advantages, ref_log_probs)
    return Prepared(policy, values, adv.returns, metrics)


def separate_analysis_batches(actor: TrainState, critic: TrainState | None, learner: Learner, traj: Trajectory,
                              config: StarPOConfig, num_tags: int, step: int) -> tuple[list[tuple], dict]:
    """The separate analysis rollout ``traj`` filtered and prepared like a training batch (``agent_trainer.py:
    732-896``): ``[(prefix, Prepared, group_ids, reward_std)]`` for ``grad_norm`` (unless the filter kept nothing)
    and, with ``trainer.gradient_analysis_log_prefilter``, ``grad_norm_prefilter``; and the bookkeeping metrics."""
    shaped = analysis_config(config)
    groups = shaped.es_manager.train
    metrics = {"grad_analysis/source_env_groups": float(groups.env_groups),
               "grad_analysis/source_group_size": float(groups.group_size),
               "grad_analysis/source_batch_size": float(len(traj.group_ids))}
    batch, normalized, filtered, reward_std = select_groups(traj, shaped, num_tags, step,
                                                            filter_entropies(learner, actor, traj, shaped))
    metrics["grad_analysis/empty_after_filter"] = float(len(batch.group_ids) == 0)
    metrics |= {f"grad_analysis/{k.split('/', 1)[-1]}": v for k, v in filtered.items()}
    passes = []
    if config.trainer.gradient_analysis_log_prefilter:
        whole, whole_normalized, _, whole_std = select_groups(traj, keep_all_config(shaped), num_tags, step)
        metrics |= {"grad_analysis_prefilter/source_batch_size": float(len(traj.group_ids)),
                    "grad_analysis_prefilter/adjusted_batch_size": float(len(whole.group_ids))}
        prepared = prepare_batch(actor, critic, learner, whole, whole_normalized, shaped, 1.0)
        passes.append(("grad_norm_prefilter", prepared, whole.group_ids, whole_std))
    if len(batch.group_ids):
        metrics["grad_analysis/adjusted_batch_size"] = float(len(batch.group_ids))
        prepared = prepare_batch(actor, critic, learner, batch, normalized, shaped,
                                 filtered.get("rollout/filter_kept_ratio", 1.0))
        passes.append(("grad_norm", prepared, batch.group_ids, reward_std))
    return passes, metrics


def run_gradient_analysis(actor: TrainState, critic: TrainState | None, learner: Learner, config: StarPOConfig,
                          training: tuple | None, analysis_rollout: Callable[[], Trajectory] | None, num_tags: int,
                          step: int) -> dict:
    """RAGEN-2's gradient analysis of one step (``run_gradient_analysis``, ragen2.md §5): on the separate rollout
    ``analysis_rollout()`` when the config gives one a shape, else on ``training`` (``(Prepared, group_ids,
    reward_std)`` of the training batch, ``None`` when it is empty); norms, bookkeeping and ``group_rv_table``s."""
    rollout = config.actor_rollout_ref.rollout
    if analysis_config(config) is None:
        passes = [] if training is None else [("grad_norm", *training)]
        metrics: dict = {"grad_analysis/uses_training_batch": 1.0}
    else:
        if analysis_rollout is None:
            raise ValueError("trainer.gradient_analysis_env_groups / _group_size give the gradient analysis its own "
                             "rollout: pass update(..., analysis_rollout=) a player of that shape")
        passes, metrics = separate_analysis_batches(actor, critic, learner, analysis_rollout(), config, num_tags, step)
        metrics["grad_analysis/uses_training_batch"] = 0.0
    for prefix, prepared, group_ids, reward_std in passes:
        buckets = (np.asarray(group_ids), np.asarray(reward_std), rollout.gradient_analysis_num_buckets,
                   rollout.gradient_analysis_bucket_mode)
        metrics |= gradient_analysis(learner.grad_norms, actor.params, learner.actor_frozen, prepared.policy,
                                     *buckets, prefix=prefix)
        metrics |= group_rv_tables(*buckets, prefix=prefix)
    return metrics


def update(actor: TrainState, critic: TrainState | None, learner: Learner, traj: Trajectory,
           config: StarPOConfig, num_tags: int = 1, step: int = 0,
           analysis_rollout: Callable[[], Trajectory] | None = None) -> tuple[TrainState, TrainState | None,
                                                                            dict[str, Any]]:
    """Filters, scores and trains on one rollout (iteration ``step``, 0-based); returns the new states and
    RAGEN-named metrics (floats, and the gradient analysis's ``runtime.metrics.Table``s).

    The critic trains ``critic.ppo_epochs`` epochs, then (from iteration ``trainer.critic_warmup`` on, counted
    from 1) the actor ``actor_rollout_ref.actor.ppo_epochs`` epochs, each over its own mini-batches, in a
    permutation seeded by ``seed.train`` and ``step`` with ``actor_rollout_ref.actor.shuffle``. On the gradient
    analysis's steps it runs between the two (on ``analysis_rollout()``'s batch when the analysis has its own
    shape); ``trainer.gradient_analysis_only`` skips both updates, ``trainer.exit_after_gradient_analysis``
    returns right after the analysis with ``trainer/exited_after_gradient_analysis``.
    """
    timing: dict[str, float] = {}
    clock = time.perf_counter()
    batch, normalized, metrics, reward_std = select_groups(traj, config, num_tags, step,
                                                           filter_entropies(learner, actor, traj, config))
    rows = len(batch.group_ids)
    mini = _batch_sizes(config, "actor_rollout_ref.actor")[0]
    trainer = config.trainer
    metrics |= {"train/batch_size": float(rows), "train/num_mini_batches": float(rows // mini),
                "train/rollout_attempts": 1.0, "trainer/gradient_analysis_only": float(trainer.gradient_analysis_only)}
    analyse = (learner.grad_norms is not None and step % trainer.gradient_analysis_every == 0
               and trainer.critic_warmup <= step + 1)
    if not rows:  # RAGEN-2 skips the update of a step whose filter kept nothing (ragen2.md §4.8)
        if analyse and trainer.gradient_analysis_only:  # a probe still analyses its separate batch
            metrics |= run_gradient_analysis(actor, critic, learner, config, None, analysis_rollout, num_tags, step)
            metrics |= {"trainer/exited_after_gradient_analysis": 1.0} if trainer.exit_after_gradient_analysis else {}
        return actor, critic, _host_metrics(metrics, [])
    prepared = prepare_batch(actor, critic, learner, batch, normalized, config,
                             metrics.get("rollout/filter_kept_ratio", 1.0))
    timing["timing_s/old_log_prob"] = prepared.metrics.pop("timing_s/old_log_prob")
    metrics |= prepared.metrics
    policy_batch = prepared.policy
    ids, mask, loss_mask = policy_batch.input_ids, policy_batch.attention_mask, policy_batch.loss_mask

    rows_sharding = batch_sharding(actor.step.sharding.mesh, 2)
    actor_cfg = config.actor_rollout_ref.actor
    key = jax.random.fold_in(jax.random.key(config.seed.train), step) if actor_cfg.shuffle else None
    step_metrics: list[dict] = []
    if critic is not None and trainer.gradient_analysis_only:
        metrics["critic/skipped_for_gradient_analysis_only"] = 1.0
    elif critic is not None:  # the critic's shuffle follows the actor's, as verl's config interpolates it
        critic, step_metrics = run_epochs(
            learner.critic_step, critic, learner.critic_frozen,
            CriticBatch(ids, mask, loss_mask, prepared.values, prepared.returns), _batch_sizes(config, "critic")[0],
            config.critic.ppo_epochs, None if key is None else jax.random.fold_in(key, 1), rows_sharding)
    if trainer.critic_warmup <= step + 1:  # verl: the actor trains once critic_warmup <= global step
        if analyse:  # RAGEN-2: after the critic, before the actor (ragen2.md §5.2)
            metrics |= run_gradient_analysis(actor, critic, learner, config, (prepared, batch.group_ids, reward_std),
                                             analysis_rollout, num_tags, step)
            if trainer.exit_after_gradient_analysis:
                metrics["trainer/exited_after_gradient_analysis"] = 1.0
                return actor, critic, _host_metrics(metrics, step_metrics)
        if trainer.gradient_analysis_only:
            metrics["actor/skipped_for_gradient_analysis_only"] = 1.0
        else:
            actor, actor_metrics = run_epochs(
                learner.actor_step, actor, learner.actor_frozen, policy_batch,
                _batch_sizes(config, "actor_rollout_ref.actor")[0], actor_cfg.ppo_epochs,
                None if key is None else jax.random.fold_in(key, 0), rows_sharding)
            step_metrics += actor_metrics
    timing["timing_s/update"] = time.perf_counter() - clock - timing["timing_s/old_log_prob"]
    return actor, critic, _host_metrics(metrics, step_metrics) | timing


def _host_metrics(metrics: dict, step_metrics: list[dict]) -> dict[str, Any]:
    """``metrics`` and the steps' metrics (averaged; running counters at their last value) as floats; tables kept."""
    tables = {k: v for k, v in metrics.items() if isinstance(v, Table)}
    host = {k: float(v) for k, v in jax.device_get({k: v for k, v in metrics.items() if k not in tables}).items()}
    for name, values in _collect(jax.device_get(step_metrics)).items():
        host[name] = float(values[-1] if name.endswith(NON_FINITE_COUNTERS) else np.mean(values))
    return host | tables
