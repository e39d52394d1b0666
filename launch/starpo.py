"""Train StarPO / StarPO-S on RAGEN's environments (RAGEN's ``train.py``).

    python -m launch.starpo --preset starpo-s-ppo --out runs/sokoban model_path=<hf folder or id> \\
        es_manager.train.env_configs.tags=[SimpleSokoban] trainer.total_training_steps=200

Without ``model_path`` it runs the embedded demo (``launch.demo_starpo``): a small
tokenizer and policy built locally, SFT on solver demonstrations, then StarPO-S on
Bandit and FrozenLake; nothing is downloaded.

Each iteration: host-driven rollout of ``env_groups × group_size`` trajectories,
then ``starpo_jax.iteration.update``; validation every ``trainer.test_freq``
iterations; metrics to JSONL and TensorBoard; decoded validation and training
rollouts to ``<out>/rollouts``; Echo Trap warnings in the log; checkpoints to
``<out>/checkpoints`` (resumed automatically; SIGTERM or SIGINT saves and exits with
``PREEMPTED_EXIT_CODE``); the final policy exported as a Hugging Face folder ``<out>/hf_model``.
``<out>`` is a ``runtime.run_folder.RunFolder``: locked while a run writes it, its resolved config
recorded in ``<out>/config.json``; a resume with other values is refused unless
``--allow-change`` names the keys (e.g. ``trainer.total_training_steps``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

import envs
from envs.base import TextEnvironment
from runtime.checkpoint import Checkpointer
from runtime.guards import NonFiniteError, NonFiniteGuard
from runtime.mesh import make_mesh
from runtime.metrics import MetricWriter, ProgressBar
from runtime.preemption import PreemptionHandler
from runtime.run_folder import RunFolder
from runtime.wandb_logger import WandbLogger
from starpo_jax.config import EnvGroupsConfig, StarPOConfig
from starpo_jax.echo_trap import EchoTrapMonitor
from starpo_jax.env_manager import GymnaxHostEnv, reset_slot, slot_metrics
from starpo_jax.fused_rollout import build_env_tables, fused_rollout, make_fused_rollout
from starpo_jax.iteration import build_learner, num_micro_batches, update
from starpo_jax.models.hf_io import check_model_folder, load_pretrained, save_pretrained
from starpo_jax.models.kv_cache import init_cache
from starpo_jax.models.lora import LoRAConfig
from starpo_jax.presets import PRESETS, load_config, mesh_config
from starpo_jax.rollout import RolloutSettings, host_rollout
from starpo_jax.sampler import SamplerConfig, make_sampler
from starpo_jax.tokenizer import load_tokenizer, require_chat_template


def make_slots(groups: EnvGroupsConfig, seed: int, custom_envs: Mapping[str, envs.EnvEntry]) -> list:
    """``env_groups × group_size`` fresh slots, group-major; all rollouts of a group share a seed.

    Each tag's environment is the one its ``custom_envs`` entry configures; a host-only one
    (Countdown) keeps its state, so every slot gets its own.
    """
    slots = []
    group = 0
    for tag_id, (tag, n_groups) in enumerate(zip(groups.env_configs.tags, groups.env_configs.n_groups)):
        text_env = envs.make(tag, custom_envs)
        for _ in range(n_groups):
            for _ in range(groups.group_size):
                env = GymnaxHostEnv(text_env) if isinstance(text_env, TextEnvironment) else envs.make(tag, custom_envs)
                slots.append(reset_slot(env, seed + group, group, tag_id))
            group += 1
    return slots


def env_metrics(rows: list[dict[str, float]], tag_ids: np.ndarray, scores: np.ndarray, tags: Sequence[str],
                prefix: str) -> dict[str, float]:
    """``{prefix}/{Tag}/{success,num_actions,action_is_effective,action_is_valid}`` means over trajectories
    (``rows``: one ``slot_metrics`` dict each), and ``{prefix}/{Tag}/reward/{mean,std}`` of their ``scores``."""
    out: dict[str, float] = {}
    for tag_id, tag in enumerate(tags):
        tagged = np.flatnonzero(np.asarray(tag_ids) == tag_id)
        if not len(tagged):
            continue
        for name in rows[tagged[0]]:
            out[f"{prefix}/{tag}/{name}"] = float(np.mean([rows[i][name] for i in tagged]))
        tag_scores = np.asarray(scores)[tagged]
        out[f"{prefix}/{tag}/reward/mean"] = float(tag_scores.mean())
        out[f"{prefix}/{tag}/reward/std"] = float(tag_scores.std())
    return out


def save_rollouts(path: Path, tokenizer, traj, rows: list[dict[str, float]], tags: Sequence[str]) -> None:
    """One JSON line per trajectory: decoded training text, score, penalty, success, group and tag."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i, row in enumerate(rows):
            text = tokenizer.decode(traj.input_ids[i][traj.attention_mask[i] > 0])
            f.write(json.dumps({"group_id": int(traj.group_ids[i]), "tag": tags[traj.tag_ids[i]],
                                "score": float(traj.scores[i]), "penalty": float(traj.penalty[i]),
                                "success": bool(row["success"]), "text": text}) + "\n")


def make_player(config: StarPOConfig, groups: EnvGroupsConfig, graphdef, model_config, sampler_config: SamplerConfig,
                tokenizer, settings: RolloutSettings, mesh: Mesh) -> Callable:
    """``play(params, seed, key) -> (trajectory, rows)`` for ``groups`` with ``agent_proxy.rollout_driver``.

    Group g plays from ``seed + g`` with either driver; ``rows`` are the per-trajectory env metrics.
    """
    if config.agent_proxy.rollout_driver == "fused":
        tables = [build_env_tables(envs.make(tag, config.custom_envs), tokenizer, settings)
                  for tag in groups.env_configs.tags]
        sizes = [n * groups.group_size for n in groups.env_configs.n_groups]
        program = make_fused_rollout(graphdef, model_config, sampler_config, tables, sizes, tokenizer, settings, mesh)
        group_ids = np.repeat(np.arange(groups.env_groups), groups.group_size)

        def play_fused(params, seed: int, key):
            out = fused_rollout(program, params, tokenizer, seed + group_ids, group_ids, key)
            return out.trajectory, out.metrics

        return play_fused
    sampler = make_sampler(graphdef, sampler_config)

    def play_host(params, seed: int, key):
        slots = make_slots(groups, seed, config.custom_envs)
        cache = init_cache(model_config, len(slots), settings.max_model_len + sampler_config.max_new_tokens)
        return host_rollout(sampler, params, tokenizer, slots, cache, key, settings), list(map(slot_metrics, slots))

    return play_host


def rollout_settings(config: StarPOConfig) -> RolloutSettings:
    proxy, rollout = config.agent_proxy, config.actor_rollout_ref.rollout
    return RolloutSettings(max_turn=proxy.max_turn, max_actions_per_turn=proxy.max_actions_per_turn,
                           enable_think=proxy.enable_think, format_penalty=config.es_manager.format_penalty,
                           max_model_len=rollout.max_model_len, train_on_sampled_ids=config.train_on_sampled_ids,
                           enable_response_mask=config.enable_response_mask, mask_alignment=config.mask_alignment,
                           max_context_window=proxy.max_context_window, use_turn_scores=proxy.use_turn_scores)


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
    lora = LoRAConfig(rank=config.lora.rank, alpha=float(config.lora.alpha)) if config.lora.rank else None
    micro = num_micro_batches(config, mesh)
    rollout_cfg = config.actor_rollout_ref.rollout
    train_tags = config.es_manager.train.env_configs.tags
    with jax.set_mesh(mesh):
        numerics = dict(dtype=config.dtype, remat=config.remat, attention_chunk=config.attention_chunk)
        policy = load_pretrained(config.model_path, mesh, lora=lora, seed=config.seed.train, **numerics)
        critic_model = None
        if config.use_critic:
            critic_model = load_pretrained(config.model_path, mesh, critic=True, lora=lora, seed=config.seed.train,
                                           **numerics)
        learner, actor, critic, graphdef = build_learner(config, policy, critic_model, mesh, micro)
        frozen = learner.actor_frozen
        stop = (tokenizer.eos_token_id,)
        top_k = max(rollout_cfg.top_k, 0)
        settings = dataclasses.replace(rollout_settings(config), bucket=rollout_bucket)
        train_play = make_player(config, config.es_manager.train, graphdef, policy.config, SamplerConfig(
            rollout_cfg.response_length, rollout_cfg.temperature, rollout_cfg.top_p, top_k, stop_ids=stop,
            pad_id=tokenizer.pad_token_id), tokenizer, settings, mesh)
        val_play = make_player(config, config.es_manager.val, graphdef, policy.config, SamplerConfig(
            rollout_cfg.response_length, rollout_cfg.val_kwargs.temperature, rollout_cfg.top_p, top_k,
            greedy=not rollout_cfg.val_kwargs.do_sample, stop_ids=stop, pad_id=tokenizer.pad_token_id),
            tokenizer, settings, mesh)

        def validate(step: int) -> dict[str, float]:
            params = nnx.merge_state(actor.params, frozen)
            traj, rows = val_play(params, config.seed.val, jax.random.key(config.seed.val))
            val_tags = config.es_manager.val.env_configs.tags
            save_rollouts(out / "rollouts" / f"val_step{step}.jsonl", tokenizer, traj, rows, val_tags)
            return env_metrics(rows, traj.tag_ids, traj.scores, val_tags, "val")

        total = config.trainer.total_training_steps
        wandb = None
        if "wandb" in config.trainer.logger:
            wandb = WandbLogger(config.trainer.project_name, config.trainer.experiment_name,
                                dataclasses.asdict(config), out)
        with Checkpointer(out / "checkpoints", max_to_keep=2) as ckpt, MetricWriter(out, wandb=wandb) as writer, \
                PreemptionHandler() as preemption:
            echo_trap = EchoTrapMonitor()
            restored, loop, start = run.resume(ckpt, {"actor": actor, "critic": critic}, total)
            actor, critic = restored["actor"], restored["critic"]
            if "echo_trap" in loop:  # absent in checkpoints of older versions
                echo_trap.load_state_dict(loop["echo_trap"])
            last: dict[str, float] = {}

            def checkpoint(done: int) -> None:
                loop_state = {"step": done, "echo_trap": echo_trap.state_dict(), **run.checkpoint_record}
                ckpt.save(done, {"actor": actor, "critic": critic}, loop_state)

            guard = NonFiniteGuard(config.trainer.max_consecutive_non_finite,
                                   keys=("actor/consecutive_non_finite", "critic/consecutive_non_finite"))
            if start == 0 and config.trainer.val_before_train:
                writer.write(0, validate(0))
            with ProgressBar(total, "StarPO", keys=("train/success", "actor/pg_loss"), start=start) as bar:
                for step in range(start, total):
                    clock = time.perf_counter()
                    seed = config.seed.train + step * config.es_manager.train.env_groups
                    traj, rows = train_play(nnx.merge_state(actor.params, frozen), seed,
                                            jax.random.fold_in(actor.rng, step))
                    generation = time.perf_counter() - clock
                    actor, critic, metrics = update(actor, critic, learner, traj, config, len(train_tags))
                    metrics.update(env_metrics(rows, traj.tag_ids, traj.scores, train_tags, "train"))
                    metrics["train/success"] = float(np.mean([row["success"] for row in rows]))
                    metrics.update({"timing_s/gen": generation, "timing_s/step": time.perf_counter() - clock})
                    if config.trainer.test_freq > 0 and (step + 1) % config.trainer.test_freq == 0:
                        metrics.update(validate(step + 1))
                        save_rollouts(out / "rollouts" / f"train_step{step + 1}.jsonl", tokenizer, traj, rows,
                                      train_tags)
                    last = writer.write(step + 1, metrics)
                    for warning in echo_trap.update(step + 1, last):
                        logging.warning(warning)
                    bar.update(step + 1, last)
                    save_freq = config.trainer.save_freq
                    stop = preemption.requested()  # asked once: a signal between two asks would skip the save
                    due = stop or step + 1 == total or (save_freq > 0 and (step + 1) % save_freq == 0)
                    if due:
                        checkpoint(step + 1)
                    try:
                        guard.check(step + 1, last)
                    except NonFiniteError:  # skipped updates left the last finite parameters: keep them
                        if not due:
                            checkpoint(step + 1)
                        logging.error("saved the last finite state as checkpoint %d in %s", step + 1, ckpt.directory)
                        raise
                    if stop:
                        raise preemption.stop(f"saved checkpoint {step + 1} in {ckpt.directory}")
        save_pretrained(nnx.merge(graphdef, actor.params, frozen), out / "hf_model", tokenizer=tokenizer)
    return last


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="default: starpo-s-ppo, or the demo's starpo-s-grpo without model_path")
    parser.add_argument("--out", default="runs/starpo", help="metrics, checkpoints and the exported model")
    parser.add_argument("--mesh", default="1,-1,1", help="data,fsdp,tensor sizes (one may be -1) or a MESH_PRESETS name")
    parser.add_argument("--demo-size", choices=("full", "fast"),
                        help="the embedded demo's sizes: full (default) or fast, the tiny test configuration "
                             "(minutes, numbers meaningless); only without model_path")
    parser.add_argument("--allow-change", default="", metavar="KEYS",
                        help="comma-separated config keys that may differ from the run's recorded config on resume")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    demo = not any("model_path" in o or "model-path" in o for o in overrides)
    if args.demo_size and not demo:
        parser.error("--demo-size sizes the embedded demo; it has no effect with model_path")
    allow = [key for key in args.allow_change.split(",") if key]
    if allow and demo:
        parser.error("--allow-change applies to a run on model_path=..., not to the embedded demo")
    mesh = make_mesh(mesh_config(args.mesh))
    if demo:
        from launch import demo_starpo
        config = demo_starpo.DemoConfig.fast() if args.demo_size == "fast" else demo_starpo.DemoConfig()
        return demo_starpo.run(Path(args.out), mesh, args.preset or demo_starpo.DEMO_PRESET, overrides, config)
    return train(load_config(args.preset or "starpo-s-ppo", overrides), mesh, Path(args.out), allow_changes=allow)


if __name__ == "__main__":
    main()
