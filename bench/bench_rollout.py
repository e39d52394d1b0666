"""Fused on-device rollout vs the host-driven rollout, and one training iteration's time split.

Same tiny random Qwen-style model, same locally trained chat tokenizer, same seeds, greedy
decoding (so both drivers play identical trajectories, which is checked): trajectories/s
and generated tokens/s of each driver per environment, and the ratio fused / host (> 1
means the fused driver is faster). Both train on the sampled ids (the fused driver's mode); the
host driver is also timed in its default mode, RAGEN's re-rendered cleaned turns ("host RAGEN"),
which reuses the KV cache for the common token prefix of consecutive prompts. Then one StarPO-S iteration (``starpo_jax.iteration.update``)
on the fused rollout: rollout / old log-probs / update seconds. Compile time is excluded
(one warm-up call per driver). Run: ``python -m bench.bench_rollout`` (``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench import hygiene
import envs
from runtime.mesh import MeshConfig, make_mesh
from runtime.sharding import create_sharded
from starpo_jax.chat_tokenizer import train_chat_tokenizer
from starpo_jax.env_manager import GymnaxHostEnv, reset_slot
from starpo_jax.filtering import num_kept_groups
from starpo_jax.fused_rollout import build_env_tables, fused_rollout, make_fused_rollout
from starpo_jax.iteration import build_learner, select_groups, update
from starpo_jax.models.config import TransformerConfig
from starpo_jax.models.kv_cache import init_cache
from starpo_jax.models.transformer import CausalLM, Critic
from starpo_jax.presets import load_config
from starpo_jax.rollout import RolloutSettings, host_rollout
from starpo_jax.sampler import SamplerConfig, make_sampler
from starpo_jax.trajectory import render_chat


def response_tokens(traj, turn_start_id: int) -> int:
    """Assistant tokens after the forced tag ("standard" loss mask minus one forced tag per assistant turn).

    A response cut at the length cap also counts the turn-end token the driver appends.
    """
    assistant_turns = ((np.asarray(traj.input_ids) == turn_start_id).sum(axis=1) - 1) // 2
    return int(np.asarray(traj.loss_mask).sum() - assistant_turns.sum())


def timed(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tags", nargs="+", default=["Bandit", "FrozenLake", "SimpleSokoban"])
    parser.add_argument("--batch", type=int, default=32, help="trajectories per rollout (group size 4)")
    parser.add_argument("--max-turn", type=int, default=3)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    hygiene.add_threads_argument(parser)
    args = parser.parse_args()
    hygiene.start(args.threads)

    corpus = []
    for tag in args.tags:
        slots = [reset_slot(GymnaxHostEnv(envs.make(tag)), seed, 0, 0) for seed in range(4)]
        corpus += [render_chat(s.prefix, s.history)[1]["content"] for s in slots] * 5
    tokenizer = train_chat_tokenizer(corpus + ["<think>go</think><answer>Up || Left</answer>"] * 20,
                                     tempfile.mkdtemp(), vocab_size=1024)
    model_config = TransformerConfig(vocab_size=len(tokenizer), hidden_size=args.hidden,
                                     intermediate_size=3 * args.hidden, num_layers=args.layers, num_heads=4,
                                     num_kv_heads=2, head_dim=args.hidden // 4)
    mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    settings = RolloutSettings(max_turn=args.max_turn, max_model_len=args.max_model_len, train_on_sampled_ids=True,
                               mask_alignment="standard")
    sampler_config = SamplerConfig(args.response_length, greedy=True, stop_ids=(tokenizer.eos_token_id,),
                                   pad_id=tokenizer.pad_token_id)
    turn_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    with jax.set_mesh(mesh):
        policy = create_sharded(lambda: CausalLM(model_config, rngs=nnx.Rngs(0)), mesh)
        graphdef, params = nnx.split(policy)
        host_sampler = make_sampler(graphdef, sampler_config, mesh=mesh)
        seeds = [100 + i // 4 for i in range(args.batch)]
        print(f"rollout: batch {args.batch}, max_turn {args.max_turn}, response_length {args.response_length}, "
              f"model hidden {args.hidden} x {args.layers} layers, vocab {len(tokenizer)}, greedy, CPU")
        print(f"{'env':>14} {'host traj/s':>12} {'fused traj/s':>13} {'host tok/s':>11} {'fused tok/s':>12} "
              f"{'fused/host':>11} {'fused compile s':>16} {'host RAGEN traj/s':>18} {'fused/host RAGEN':>17}")
        fused_programs = {}
        for tag in args.tags:
            tables = build_env_tables(envs.make(tag), tokenizer, settings)
            program = make_fused_rollout(graphdef, model_config, sampler_config, [tables], [args.batch], tokenizer,
                                         settings, mesh)
            fused_programs[tag] = program

            def run_host(settings=settings):
                slots = [reset_slot(GymnaxHostEnv(envs.make(tag)), s, i // 4, 0) for i, s in enumerate(seeds)]
                cache = init_cache(model_config, args.batch, args.max_model_len + args.response_length, mesh=mesh)
                return host_rollout(host_sampler, params, tokenizer, slots, cache, jax.random.key(0), settings)

            def run_host_ragen():
                return run_host(dataclasses.replace(settings, train_on_sampled_ids=False))

            def run_fused():
                return fused_rollout(program, params, tokenizer, seeds, [i // 4 for i in range(args.batch)],
                                     jax.random.key(0)).trajectory

            start = time.perf_counter()
            run_fused()
            compile_s = time.perf_counter() - start
            run_host()
            host_s, host_traj = timed(run_host, args.repeats)
            fused_s, fused_traj = timed(run_fused, args.repeats)
            run_host_ragen()
            ragen_s, _ = timed(run_host_ragen, args.repeats)
            same = all(np.array_equal(a, b) for name, a, b in zip(host_traj._fields, host_traj, fused_traj)
                       if name != "rollout_log_probs")  # NaN-filled; float32 rounding apart between drivers
            tokens = response_tokens(fused_traj, turn_start)
            print(f"{tag:>14} {args.batch / host_s:>12.1f} {args.batch / fused_s:>13.1f} {tokens / host_s:>11.1f} "
                  f"{tokens / fused_s:>12.1f} {host_s / fused_s:>11.2f} {compile_s:>16.1f} "
                  f"{args.batch / ragen_s:>18.1f} {ragen_s / fused_s:>17.2f}"
                  + ("" if same else "  (trajectories differ!)"))

        tag = args.tags[-1]
        groups = args.batch // 4
        kept = num_kept_groups(groups, 0.25) * 4
        config = load_config("starpo-s-ppo", (
            f"es_manager.train.env_groups={groups}", "es_manager.train.group_size=4",
            f"es_manager.train.env_configs.n_groups=[{groups}]", f"es_manager.train.env_configs.tags=[{tag}]",
            f"ppo_mini_batch_size={kept}", f"micro_batch_size_per_gpu={min(4, kept)}",
            "train_on_sampled_ids=True", "agent_proxy.rollout_driver=fused"))
        critic = create_sharded(lambda: Critic(model_config, rngs=nnx.Rngs(1)), mesh)
        learner, actor, critic_state, _ = build_learner(config, policy, critic, mesh)
        frozen = learner.actor_frozen

        def iteration(actor, critic_state):
            start = time.perf_counter()
            traj = fused_rollout(fused_programs[tag], nnx.merge_state(actor.params, frozen), tokenizer, seeds,
                                 [i // 4 for i in range(args.batch)], jax.random.key(0)).trajectory
            rollout_s = time.perf_counter() - start
            actor, critic_state, _ = update(actor, critic_state, learner, traj, config)  # ends on device_get
            return actor, critic_state, traj, rollout_s, time.perf_counter() - start - rollout_s

        actor, critic_state, *_ = iteration(actor, critic_state)  # compiles the steps
        actor, critic_state, traj, rollout_s, update_total = iteration(actor, critic_state)
        # update() times its log-prob pass without waiting for it (async dispatch): time it here, synchronised.
        batch = select_groups(traj, config, 1)[0]
        ids, mask = jnp.asarray(batch.input_ids), jnp.asarray(batch.attention_mask)
        log_prob_s, _ = timed(lambda: jax.block_until_ready(learner.log_probs(actor.params, frozen, ids, mask)), 3)
        update_s = update_total - log_prob_s
        total = rollout_s + update_total
        print(f"\none starpo-s-ppo iteration on {tag} (fused rollout, {args.batch} trajectories, filter 0.25):")
        for name, seconds in (("rollout", rollout_s), ("old log-probs", log_prob_s),
                              ("values + critic + actor update", update_s)):
            print(f"  {name:>30}: {seconds:7.2f} s ({100 * seconds / total:4.1f}%)")


if __name__ == "__main__":
    main()
