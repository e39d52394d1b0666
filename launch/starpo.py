"""Train StarPO / StarPO-S on RAGEN's environments (RAGEN's ``train.py``).

    python -m launch.starpo --preset starpo-s-ppo --out runs/sokoban model_path=<hf folder or id> \\
        es_manager.train.env_configs.tags=[SimpleSokoban] trainer.total_training_steps=200

Each iteration: host-driven rollout of ``env_groups × group_size`` trajectories,
then ``starpo_jax.iteration.update``; validation every ``trainer.test_freq``
iterations; metrics to JSONL and TensorBoard; decoded validation and training
rollouts to ``<out>/rollouts``; Echo Trap warnings in the log; checkpoints to
``<out>/checkpoints`` (resumed automatically, SIGTERM saves and exits); the final
policy exported as a Hugging Face folder ``<out>/hf_model``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Sequence

import jax
import numpy as np
from flax import nnx

import envs
from runtime.checkpoint import Checkpointer
from runtime.distributed import initialize
from runtime.mesh import MeshConfig, make_mesh
from runtime.metrics import MetricWriter, ProgressBar
from runtime.preemption import PreemptionHandler
from starpo_jax.config import EnvGroupsConfig, StarPOConfig
from starpo_jax.echo_trap import EchoTrapMonitor
from starpo_jax.env_manager import GymnaxHostEnv, reset_slot, slot_metrics
from starpo_jax.iteration import build_learner, num_micro_batches, update
from starpo_jax.models.hf_io import load_pretrained, save_pretrained
from starpo_jax.models.kv_cache import init_cache
from starpo_jax.models.lora import LoRAConfig
from starpo_jax.presets import PRESETS, load_config
from starpo_jax.rollout import RolloutSettings, host_rollout
from starpo_jax.sampler import SamplerConfig, make_sampler
from starpo_jax.tokenizer import load_tokenizer


def make_slots(groups: EnvGroupsConfig, seed: int) -> list:
    """``env_groups × group_size`` fresh slots, group-major; all rollouts of a group share a seed."""
    slots = []
    group = 0
    for tag_id, (tag, n_groups) in enumerate(zip(groups.env_configs.tags, groups.env_configs.n_groups)):
        text_env = envs.make(tag)
        for _ in range(n_groups):
            for _ in range(groups.group_size):
                env = envs.make(tag) if tag == "Countdown" else GymnaxHostEnv(text_env)
                slots.append(reset_slot(env, seed + group, group, tag_id))
            group += 1
    return slots


def env_metrics(slots: list, tags: Sequence[str], prefix: str) -> dict[str, float]:
    """``{prefix}/{Tag}/{success,num_actions,action_is_effective,action_is_valid}`` means over trajectories."""
    out: dict[str, float] = {}
    for tag_id, tag in enumerate(tags):
        rows = [slot_metrics(s) for s in slots if s.tag_id == tag_id]
        for name in (rows[0] if rows else {}):
            out[f"{prefix}/{tag}/{name}"] = float(np.mean([r[name] for r in rows]))
    return out


def save_rollouts(path: Path, tokenizer, traj, slots: list, tags: Sequence[str]) -> None:
    """One JSON line per trajectory: decoded training text, score, penalty, success, group and tag."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i, slot in enumerate(slots):
            text = tokenizer.decode(traj.input_ids[i][traj.attention_mask[i] > 0])
            f.write(json.dumps({"group_id": slot.group_id, "tag": tags[slot.tag_id], "score": slot.score,
                                "penalty": slot.penalty, "success": slot.success, "text": text}) + "\n")


def rollout_settings(config: StarPOConfig) -> RolloutSettings:
    proxy, rollout = config.agent_proxy, config.actor_rollout_ref.rollout
    return RolloutSettings(max_turn=proxy.max_turn, max_actions_per_turn=proxy.max_actions_per_turn,
                           enable_think=proxy.enable_think, format_penalty=config.es_manager.format_penalty,
                           max_model_len=rollout.max_model_len, train_on_sampled_ids=config.train_on_sampled_ids,
                           enable_response_mask=config.enable_response_mask, mask_alignment=config.mask_alignment)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="starpo-s-ppo", choices=sorted(PRESETS))
    parser.add_argument("--out", default="runs/starpo", help="metrics, checkpoints and the exported model")
    parser.add_argument("--mesh", default="1,-1,1", help="data,fsdp,tensor sizes; one may be -1")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    config = load_config(args.preset, overrides)
    initialize()
    mesh = make_mesh(MeshConfig(*(int(x) for x in args.mesh.split(","))))
    out = Path(args.out)
    tokenizer = load_tokenizer(config.model_path)
    lora = LoRAConfig(rank=config.lora.rank, alpha=float(config.lora.alpha)) if config.lora.rank else None
    micro = num_micro_batches(config, mesh)
    rollout_cfg = config.actor_rollout_ref.rollout
    train_tags = config.es_manager.train.env_configs.tags
    with jax.set_mesh(mesh):
        policy = load_pretrained(config.model_path, mesh, lora=lora, seed=config.seed.train)
        critic_model = None
        if config.use_critic:
            critic_model = load_pretrained(config.model_path, mesh, critic=True, lora=lora, seed=config.seed.train)
        learner, actor, critic, graphdef = build_learner(config, policy, critic_model, mesh, micro)
        frozen = learner.actor_frozen
        stop = (tokenizer.eos_token_id,)
        top_k = max(rollout_cfg.top_k, 0)
        train_sampler = make_sampler(graphdef, SamplerConfig(rollout_cfg.response_length, rollout_cfg.temperature,
                                                             rollout_cfg.top_p, top_k, stop_ids=stop,
                                                             pad_id=tokenizer.pad_token_id))
        val_sampler = make_sampler(graphdef, SamplerConfig(
            rollout_cfg.response_length, rollout_cfg.val_kwargs.temperature, rollout_cfg.top_p, top_k,
            greedy=not rollout_cfg.val_kwargs.do_sample, stop_ids=stop, pad_id=tokenizer.pad_token_id))
        settings = rollout_settings(config)

        def play(sampler, groups: EnvGroupsConfig, seed: int, key):
            slots = make_slots(groups, seed)
            cache = init_cache(policy.config, len(slots), rollout_cfg.max_model_len + rollout_cfg.response_length)
            params = nnx.merge_state(actor.params, frozen)
            return host_rollout(sampler, params, tokenizer, slots, cache, key, settings), slots

        def validate(step: int) -> dict[str, float]:
            traj, slots = play(val_sampler, config.es_manager.val, config.seed.val, jax.random.key(config.seed.val))
            val_tags = config.es_manager.val.env_configs.tags
            save_rollouts(out / "rollouts" / f"val_step{step}.jsonl", tokenizer, traj, slots, val_tags)
            return env_metrics(slots, val_tags, "val")

        total = config.trainer.total_training_steps
        with Checkpointer(out / "checkpoints", max_to_keep=2) as ckpt, MetricWriter(out) as writer, \
                PreemptionHandler() as preemption:
            start = 0
            if ckpt.latest_step() is not None:
                restored, loop, start = ckpt.restore({"actor": actor, "critic": critic})
                actor, critic = restored["actor"], restored["critic"]
            last: dict[str, float] = {}
            echo_trap = EchoTrapMonitor()
            if start == 0 and config.trainer.val_before_train:
                writer.write(0, validate(0))
            with ProgressBar(total, "StarPO", keys=("train/success", "actor/pg_loss"), start=start) as bar:
                for step in range(start, total):
                    clock = time.perf_counter()
                    seed = config.seed.train + step * config.es_manager.train.env_groups
                    traj, slots = play(train_sampler, config.es_manager.train, seed, jax.random.fold_in(actor.rng, step))
                    generation = time.perf_counter() - clock
                    actor, critic, metrics = update(actor, critic, learner, traj, config, len(train_tags))
                    metrics.update(env_metrics(slots, train_tags, "train"))
                    metrics["train/success"] = float(np.mean([s.success for s in slots]))
                    metrics.update({"timing_s/gen": generation, "timing_s/step": time.perf_counter() - clock})
                    if (step + 1) % config.trainer.test_freq == 0:
                        metrics.update(validate(step + 1))
                        save_rollouts(out / "rollouts" / f"train_step{step + 1}.jsonl", tokenizer, traj, slots,
                                      train_tags)
                    last = writer.write(step + 1, metrics)
                    for warning in echo_trap.update(step + 1, last):
                        logging.warning(warning)
                    bar.update(step + 1, last)
                    save_freq = config.trainer.save_freq
                    if preemption.requested() or step + 1 == total or (save_freq > 0 and (step + 1) % save_freq == 0):
                        ckpt.save(step + 1, {"actor": actor, "critic": critic}, {"step": step + 1})
                    if preemption.requested():
                        return last
        save_pretrained(nnx.merge(graphdef, actor.params, frozen), out / "hf_model", tokenizer=tokenizer)
    return last


if __name__ == "__main__":
    main()
