"""RAGEN-2's environments: steps/s of ours (jitted, vmapped) vs plain Python/NumPy peers, and fused vs host rollouts.

    python -m bench.bench_envs_v2 [--batches 1 1024 8192] [--steps 100] [--peer-steps 2000]
        [--rows 8] [--max-turn 3] [--new-tokens 16]

Part 1: steps/s of 2048, the 2x2 cube and Sudoku 9x9 (random actions, episodes not reset) against the
single-environment peers of ``bench/env_peers.py`` (RAGEN's rules in Python/NumPy, stepped one at a time as
RAGEN's classes are, reset when done). Part 2: whole-episode trajectories/s of the fused driver vs the host
driver on 2048 and the cube (``--rows`` each) with a tiny random-weight transformer and a tokenizer trained on
the environments' texts; every call is timed after a warm-up call (compilation excluded).
"""

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

import envs
from bench.bench_envs import our_step_rate, timed
from bench.env_peers import Peer2048, PeerCube, PeerSudoku
from envs.sudoku import SudokuCore
from starpo_jax.chat_tokenizer import train_chat_tokenizer
from starpo_jax.env_manager import GymnaxHostEnv, reset_slot
from starpo_jax.fused_rollout import build_env_tables, fused_rollout, make_fused_rollout
from starpo_jax.models.config import TransformerConfig
from starpo_jax.models.kv_cache import init_cache
from starpo_jax.models.transformer import CausalLM
from starpo_jax.rollout import RolloutSettings, host_rollout
from starpo_jax.sampler import SamplerConfig, make_sampler
from starpo_jax.trajectory import render_chat


def peer_rate(make_peer, actions, steps: int) -> float:
    """Steps/s of one peer environment, reset with a new seed whenever an episode ends."""
    peer, rng = make_peer(), np.random.default_rng(0)
    peer.reset(0)
    start = time.perf_counter()
    for k in range(steps):
        out = peer.step(actions(rng))
        if out[-2 if len(out) == 4 else -1]:
            peer.reset(k + 1)
    return steps / (time.perf_counter() - start)


def env_table(batches, steps: int, peer_steps: int) -> None:
    sudoku = SudokuCore()
    rows = [("2048", envs.make("game_2048", envs.CUSTOM_ENVS_V2), Peer2048, lambda r: int(r.integers(4))),
            ("cube", envs.make("rubikscube", envs.CUSTOM_ENVS_V2), PeerCube, lambda r: int(r.integers(12))),
            ("sudoku 9x9", sudoku, PeerSudoku,
             lambda r: f"{r.integers(1, 10)},{r.integers(1, 10)},{r.integers(1, 10)}")]
    print(f"{'env':>11} | {'peer steps/s':>12} | " + " | ".join(f"{'batch ' + str(b):>14} {'ratio':>8}" for b in batches))
    for name, env, peer, actions in rows:
        reference = peer_rate(peer, actions, peer_steps)
        cells = []
        for batch in batches:
            _, states = jax.jit(jax.vmap(env.reset_env, (0, None)))(jax.random.split(jax.random.key(1), batch),
                                                                  env.default_params)
            ours = our_step_rate(env, states, steps)
            cells.append(f"{ours:>14,.0f} {ours / reference:>7.1f}x")
        print(f"{name:>11} | {reference:>12,.0f} | " + " | ".join(cells), flush=True)


def rollout_table(rows: int, max_turn: int, new_tokens: int) -> None:
    custom = {**envs.CUSTOM_ENVS_V2,
              "game_2048": dataclasses.replace(envs.RAGEN2_ENVS["game_2048"], max_actions_per_traj=2 * max_turn)}
    settings = RolloutSettings(max_turn=max_turn, max_model_len=2048, train_on_sampled_ids=True, bucket=1024,
                               max_actions_per_turn=2)
    tags = ("game_2048", "rubikscube")
    seeds = list(range(2 * rows))
    tag_of = [0] * rows + [1] * rows

    made = [envs.make(tag, custom) for tag in tags]  # one compiled reset/step per tag, as launch.starpo

    def slots():
        return [reset_slot(GymnaxHostEnv(made[t]), s, s, t) for s, t in zip(seeds, tag_of)]

    corpus = [render_chat(s.prefix, s.history)[1]["content"] for s in slots()]
    tokenizer = train_chat_tokenizer(corpus * 3, Path(tempfile.mkdtemp()), vocab_size=1024)
    config = TransformerConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_layers=2,
                               num_heads=4, num_kv_heads=2, head_dim=16)
    with nnx.use_eager_sharding(False):
        graphdef, params = nnx.split(CausalLM(config, rngs=nnx.Rngs(0)))
    sampler_config = SamplerConfig(max_new_tokens=new_tokens, stop_ids=(tokenizer.eos_token_id,),
                                   pad_id=tokenizer.pad_token_id)
    tables = [build_env_tables(env, tokenizer, settings) for env in made]
    program = make_fused_rollout(graphdef, config, sampler_config, tables, (rows, rows), tokenizer, settings)
    sample = make_sampler(graphdef, sampler_config)

    def host():
        cache = init_cache(config, 2 * rows, settings.max_model_len + new_tokens)
        return host_rollout(sample, params, tokenizer, slots(), cache, jax.random.key(0), settings).input_ids

    def fused():
        return fused_rollout(program, params, tokenizer, seeds, seeds, jax.random.key(0)).trajectory.input_ids

    host_s, fused_s = timed(host), timed(fused)
    n = 2 * rows
    print(f"rollout of {rows} x 2048 + {rows} x cube, {max_turn} turns, {new_tokens} new tokens/turn: "
          f"host {n / host_s:,.1f} traj/s ({host_s:.2f} s), fused {n / fused_s:,.1f} traj/s ({fused_s:.2f} s), "
          f"fused/host {host_s / fused_s:.1f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 1024, 8192])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--peer-steps", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--max-turn", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    print(f"backend: {jax.default_backend()}  devices: {jax.device_count()}")
    env_table(args.batches, args.steps, args.peer_steps)
    rollout_table(args.rows, args.max_turn, args.new_tokens)


if __name__ == "__main__":
    main()
