"""The StarPO trainer: rollout → update → validation → metrics → checkpoints (RAGEN's ``train.py`` loop).

Each iteration plays ``env_groups × group_size`` trajectories with the configured rollout driver
(``starpo_jax.rollout_drivers``), then runs ``starpo_jax.iteration.update``; validation every
``trainer.test_freq`` iterations; metrics to JSONL and TensorBoard (``runtime.metrics``); decoded validation
and training rollouts to ``<out>/rollouts``; Echo Trap warnings in the log; checkpoints, stop signals and
the non-finite stop by ``runtime.loop.resumable_loop``; the final policy exported as a Hugging Face folder
``<out>/hf_model``. ``<out>`` is a ``runtime.run_folder.RunFolder``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from runtime.checkpoint import Checkpointer
from runtime.guards import NonFiniteGuard
from runtime.loop import resumable_loop
from runtime.metrics import MetricWriter
from runtime.preemption import PreemptionHandler
from runtime.run_folder import RunFolder
from runtime.wandb_logger import WandbLogger
from starpo_jax.analysis_rollout import analysis_config
from starpo_jax.config import StarPOConfig
from starpo_jax.config_keys import lora_targets
from starpo_jax.collapse import CollapseDetector
from starpo_jax.early_stop import EarlyStop
from starpo_jax.episodes import Episodes
from starpo_jax.echo_trap import EchoTrapMonitor
from starpo_jax.iteration import build_learner, update
from starpo_jax.models.hf_io import check_model_folder, load_pretrained, save_pretrained
from starpo_jax.models.lora import LoRAConfig
from starpo_jax.rollout_drivers import make_player, rollout_settings
from starpo_jax.sampler import SamplerConfig
from starpo_jax.tokenizer import load_tokenizer, require_chat_template
from starpo_jax.turn_samples import collapse_detection_applies


# Folded into an iteration's sampling key for the gradient analysis's separate rollout.
ANALYSIS_STREAM = 1


def env_metrics(rows: list[dict[str, float]], tag_ids: np.ndarray, scores: np.ndarray, tags: Sequence[str],
                prefix: str) -> dict[str, float]:
    """``{prefix}/{Tag}/{name}`` over the tag's trajectories of every ``slot_metrics`` entry (``rows``: one dict
    each; RAGEN's ``reduce_metrics``: the max for names containing ``max``, the min for ``min``, else the mean, over
    the rows that have the entry), and ``{prefix}/{Tag}/reward/{mean,std}`` of their ``scores``."""
    out: dict[str, float] = {}
    for tag_id, tag in enumerate(tags):
        tagged = np.flatnonzero(np.asarray(tag_ids) == tag_id)
        if not len(tagged):
            continue
        for name in dict.fromkeys(name for i in tagged for name in rows[i]):
            reduce = np.max if "max" in name else np.min if "min" in name else np.mean
            out[f"{prefix}/{tag}/{name}"] = float(reduce([rows[i][name] for i in tagged if name in rows[i]]))
        tag_scores = np.asarray(scores)[tagged]
        out[f"{prefix}/{tag}/reward/mean"] = float(tag_scores.mean())
        out[f"{prefix}/{tag}/reward/std"] = float(tag_scores.std())
    return out | batch_env_metrics(out, "" if prefix == "train" else f"{prefix}/")


def batch_env_metrics(tagged: dict[str, float], prefix: str) -> dict[str, float]:
    """RAGEN-2's batch-wide ``charts/avg_episode_return`` (the mean over tags of each tag's mean episodic return)
    and ``rollout/max_tile`` (the largest tile in the batch), from ``env_metrics``' per-tag values (ragen2.md §6.8)."""
    returns = [v for k, v in tagged.items() if k.endswith("/episodic_return")]
    tiles = [v for k, v in tagged.items() if k.endswith("/max_tile")]
    return ({f"{prefix}charts/avg_episode_return": float(np.mean(returns))} if returns else {}) | (
        {f"{prefix}rollout/max_tile": float(max(tiles))} if tiles else {})


def save_rollouts(path: Path, tokenizer, traj, rows: list[dict[str, float]], tags: Sequence[str]) -> None:
    """One JSON line per trajectory: decoded training text, score, penalty, success, group and tag (per-turn
    samples: one line per turn-sample, with its ``episode``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    episodes = Episodes(traj.episode_ids, len(traj.scores))
    with open(path, "w", encoding="utf-8") as f:
        for i, episode in enumerate(episodes.index):
            text = tokenizer.decode(traj.input_ids[i][traj.attention_mask[i] > 0])
            line = {"group_id": int(traj.group_ids[i]), "tag": tags[traj.tag_ids[i]],
                    "score": float(traj.scores[i]), "penalty": float(traj.penalty[i]),
                    "success": bool(rows[episode]["success"]), "text": text}
            f.write(json.dumps(line | ({"episode": int(episode)} if episodes.turn_level else {})) + "\n")


def episode_env_metrics(rows: list[dict[str, float]], traj, tags: Sequence[str], prefix: str) -> dict[str, float]:
    """``env_metrics`` of a rollout's ``rows`` (one per trajectory), whether its rows are trajectories or
    per-turn samples (then each episode's first)."""
    first = Episodes(traj.episode_ids, len(traj.scores)).first
    return env_metrics(rows, np.asarray(traj.tag_ids)[first], np.asarray(traj.scores)[first], tags, prefix)


def analysis_player(config: StarPOConfig, graphdef, model_config, sampler: SamplerConfig, tokenizer, settings,
                    mesh: Mesh) -> Callable | None:
    """The player of the gradient analysis's separate rollout (its ``es_manager.train`` shape, the training
    sampler), or ``None`` without one (``starpo_jax.analysis_rollout``)."""
    shaped = analysis_config(config) if config.trainer.gradient_analysis_mode else None
    if shaped is None:
        return None
    return make_player(shaped, shaped.es_manager.train, graphdef, model_config, sampler, tokenizer, settings, mesh)


def analysis_rollout(play: Callable | None, config: StarPOConfig, params, rng: jax.Array,
                     step: int) -> Callable | None:
    """``() -> Trajectory``: iteration ``step``'s separate analysis rollout with ``params`` (collapse metrics off),
    on its own env seeds and sampling key; played only when the analysis runs."""
    if play is None:
        return None
    groups = analysis_config(config).es_manager.train
    return lambda: play(params, config.seed.train + step * groups.env_groups,
                        jax.random.fold_in(jax.random.fold_in(rng, step), ANALYSIS_STREAM))[0]


def lora_config(config: StarPOConfig) -> LoRAConfig | None:
    """``lora.rank`` / ``alpha`` / ``target_modules`` as the models' ``LoRAConfig``; ``None`` at rank 0."""
    if not config.lora.rank:
        return None
    return LoRAConfig(rank=config.lora.rank, alpha=float(config.lora.alpha), targets=lora_targets(config.lora))


def train(config: StarPOConfig, mesh: Mesh, out: Path, rollout_bucket: int = 32,
          allow_changes: Sequence[str] = ()) -> dict[str, float]:
    """The StarPO loop on ``config.model_path``; returns the metrics of the last iteration.

    ``rollout_bucket``: trajectories and prompts are padded to a multiple of this many
    tokens, so the compiled steps see few distinct shapes. ``allow_changes``: config keys that may
    differ from those recorded in ``out`` on resume. The model folder and ``out`` are checked
    before anything loads.
    """
    check_model_folder(config.model_path)
    with RunFolder(out, dataclasses.asdict(config), allow_changes=allow_changes) as run:
        return train_in(config, mesh, run, rollout_bucket)


def train_in(config: StarPOConfig, mesh: Mesh, run: RunFolder, rollout_bucket: int) -> dict[str, float]:
    """``train`` in its entered run folder."""
    out = run.out
    tokenizer = require_chat_template(load_tokenizer(config.model_path))
    lora = lora_config(config)
    rollout_cfg = config.actor_rollout_ref.rollout
    train_tags = config.es_manager.train.env_configs.tags
    with jax.set_mesh(mesh):
        policy = load_pretrained(config.model_path, mesh, lora=lora, seed=config.seed.train, **config.numerics)
        critic_model = None
        if config.use_critic:
            critic_model = load_pretrained(config.model_path, mesh, critic=True, lora=lora, seed=config.seed.train,
                                           **config.numerics)
        learner, actor, critic, graphdef = build_learner(config, policy, critic_model, mesh)
        frozen = learner.actor_frozen
        stop = (tokenizer.eos_token_id,)
        top_k = max(rollout_cfg.top_k, 0)
        settings = dataclasses.replace(rollout_settings(config), bucket=rollout_bucket)
        train_sampler = SamplerConfig(rollout_cfg.response_length, rollout_cfg.temperature, rollout_cfg.top_p, top_k,
                                      stop_ids=stop, pad_id=tokenizer.pad_token_id)
        train_play = make_player(config, config.es_manager.train, graphdef, policy.config, train_sampler, tokenizer,
                                 settings, mesh)
        analysis_play = analysis_player(config, graphdef, policy.config, train_sampler, tokenizer, settings, mesh)
        val_play = make_player(config, config.es_manager.val, graphdef, policy.config, SamplerConfig(
            rollout_cfg.response_length, rollout_cfg.val_kwargs.temperature, rollout_cfg.top_p, top_k,
            greedy=not rollout_cfg.val_kwargs.do_sample, stop_ids=stop, pad_id=tokenizer.pad_token_id),
            tokenizer, settings, mesh)

        detector = None
        if config.collapse_detection.enabled and collapse_detection_applies(config.agent_proxy.context_window_mode):
            # RAGEN-2's diagnostics, with the sampling temperature (ragen2.md §3.6)
            detector = CollapseDetector(config.collapse_detection, graphdef, policy.config, tokenizer,
                                        rollout_cfg.temperature, mesh, config.seed.train)
        rollout_filter = config.actor_rollout_ref.rollout
        early_stop = EarlyStop(rollout_filter.rollout_filter_empty_stop_steps if rollout_filter.rollout_filter_strategy
                               != "starpo_s" else 0, config.trainer.early_stop_reward_variance_collapse,
                               config.trainer.early_stop_low_validation_success)

        def validate(step: int, actor) -> dict[str, float]:
            clock = time.perf_counter()
            params = nnx.merge_state(actor.params, frozen)
            traj, rows = val_play(params, config.seed.val, jax.random.key(config.seed.val))
            val_tags = config.es_manager.val.env_configs.tags
            save_rollouts(out / "rollouts" / f"val_step{step}.jsonl", tokenizer, traj, rows, val_tags)
            return episode_env_metrics(rows, traj, val_tags, "val") | {"timing_s/testing": time.perf_counter() - clock}

        total, test_freq = config.trainer.total_training_steps, config.trainer.test_freq

        exited: list[int] = []  # the step that ended the run with trainer.exit_after_gradient_analysis

        def iteration(states, step: int):
            actor, critic = states
            clock = time.perf_counter()
            seed = config.seed.train + step * config.es_manager.train.env_groups
            params = nnx.merge_state(actor.params, frozen)
            traj, rows = train_play(params, seed, jax.random.fold_in(actor.rng, step))
            generation = time.perf_counter() - clock
            # Collapse metrics on the full batch before the filter, with the sampling weights; RAGEN-2 counts
            # steps from 1 and leaves their time out of the step's (ragen2.md §3.3).
            collapse = {} if detector is None else detector(params, traj, step + 1)
            clock += sum(collapse.get(f"timing_s/collapse_{k}_step", 0.0) for k in ("first_turn", "multi_turn"))
            actor, critic, metrics = update(actor, critic, learner, traj, config, len(train_tags), step,
                                            analysis_rollout(analysis_play, config, params, actor.rng, step))
            if metrics.get("trainer/exited_after_gradient_analysis"):  # RAGEN-2 returns here (ragen2.md §5.1)
                exited.append(step + 1)
            metrics |= collapse | early_stop.observe_filter(
                metrics["train/batch_size"] == 0,
                metrics.get("rollout/in_group_reward_std", metrics.get("rollout/in_group_std")))
            metrics.update(episode_env_metrics(rows, traj, train_tags, "train"))
            metrics["train/success"] = float(np.mean([row["success"] for row in rows]))
            metrics.update({"timing_s/gen": generation, "timing_s/step": time.perf_counter() - clock})
            # every test_freq iterations and after the last, as RAGEN (agent_trainer.py: ``is_last_step``)
            if test_freq > 0 and ((step + 1) % test_freq == 0 or step + 1 == total) and not exited:
                validation = validate(step + 1, actor)
                metrics |= validation | early_stop.observe_validation(validation)
                save_rollouts(out / "rollouts" / f"train_step{step + 1}.jsonl", tokenizer, traj, rows, train_tags)
            return (actor, critic), metrics

        wandb = None
        if "wandb" in config.trainer.logger:
            wandb = WandbLogger(config.trainer.project_name, config.trainer.experiment_name,
                                dataclasses.asdict(config), out)
        with Checkpointer(out / "checkpoints", max_to_keep=2) as ckpt, MetricWriter(out, wandb=wandb) as writer, \
                PreemptionHandler() as preemption:
            echo_trap = EchoTrapMonitor()
            restored, loop, start = run.resume(ckpt, {"actor": actor, "critic": critic}, total)
            if "echo_trap" in loop:  # absent in checkpoints of older versions
                echo_trap.load_state_dict(loop["echo_trap"])

            def checkpoint(done: int, states) -> None:
                if exited or (config.trainer.gradient_analysis_only and done in ckpt.steps()):  # a probe of a saved
                    return  # step: its parameters did not change
                loop_state = {"step": done, "echo_trap": echo_trap.state_dict(), **run.checkpoint_record}
                ckpt.save(done, {"actor": states[0], "critic": states[1]}, loop_state)

            def warn_echo_trap(done: int, row: dict[str, float]) -> None:
                for warning in echo_trap.update(done, row):
                    logging.warning(warning)

            if start == 0 and config.trainer.val_before_train:
                writer.write(0, validate(0, restored["actor"]))
            if config.trainer.gradient_analysis_only and start > 0:  # probe the checkpoint's own step (RAGEN-2)
                start -= 1
            guard = NonFiniteGuard(config.trainer.max_consecutive_non_finite,
                                   keys=("actor/consecutive_non_finite", "critic/consecutive_non_finite"))
            (actor, _), last = resumable_loop(
                iteration, (restored["actor"], restored["critic"]), start, total, checkpoint, writer=writer,
                guard=guard, preemption=preemption, save_every=config.trainer.save_freq,
                checkpoint_dir=ckpt.directory, description="StarPO", bar_keys=("train/success", "actor/pg_loss"),
                on_row=warn_echo_trap, stop_after=lambda: early_stop.stopped or bool(exited))
        if not exited:
            save_pretrained(nnx.merge(graphdef, actor.params, frozen), out / "hf_model", tokenizer=tokenizer)
    return last
