"""Steps per second of our jitted environments against the Python ones RAGEN steps one by one.

    python -m bench.bench_envs [--batches 1 64 1024 8192] [--steps 100] [--peer-steps 2000]

Prints, per batch size, our Sokoban vs gym-sokoban's ``SokobanEnv`` (RAGEN's base), our FrozenLake
vs gymnasium's, and Sokoban level generation vs gym-sokoban's ``reset``, with ours/peer ratios.
The peers step their environments one after another, so their rate does not depend on the batch.
gym-sokoban is timed twice: with its cheapest observation (``tiny_rgb_array``, the transition cost)
and as RAGEN calls it (``GymSokobanEnv.step(self, action)``: the default ``rgb_array`` sprites).
"""

import argparse
import time
import warnings

import gymnasium
import jax
import numpy as np

from bench import hygiene
import envs

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from gym_sokoban.envs.sokoban_env import SokobanEnv as GymSokobanEnv


def timed(fn, *args) -> float:
    """Seconds for one call after a warm-up call (compilation excluded)."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def our_step_rate(env, states, steps: int) -> float:
    """Environment steps per second of ``steps`` vmapped transitions with random actions."""
    batch = jax.tree.leaves(states)[0].shape[0]
    step = jax.vmap(env.step_env, in_axes=(0, 0, 0, None))

    @jax.jit
    def rollout(states, key):
        def body(states, key):
            k_action, k_step = jax.random.split(key)
            actions = jax.random.randint(k_action, (batch,), 0, env.num_actions)
            _, states, reward, _, _ = step(jax.random.split(k_step, batch), states, actions, env.default_params)
            return states, reward.sum()

        return jax.lax.scan(body, states, jax.random.split(key, steps))[1]

    return batch * steps / timed(rollout, states, jax.random.key(0))


def our_reset_rate(env, batch: int) -> tuple[float, object]:
    reset = jax.jit(jax.vmap(env.reset_env, in_axes=(0, None)))
    keys = jax.random.split(jax.random.key(1), batch)
    seconds = timed(lambda k: reset(k, env.default_params)[1], keys)
    return batch / seconds, reset(keys, env.default_params)[1]


def gym_sokoban_rates(num_steps: int, num_resets: int) -> tuple[float, float, float]:
    """Steps/s with tiny observations, steps/s with RAGEN's default observations, levels/s."""
    env = GymSokobanEnv(dim_room=(6, 6), num_boxes=1, max_steps=100, reset=False)
    start = time.perf_counter()
    for _ in range(num_resets):
        env.reset(render_mode="tiny_rgb_array")
    reset_rate = num_resets / (time.perf_counter() - start)
    rates = []
    for mode, count in (("tiny_rgb_array", num_steps), ("rgb_array", max(num_steps // 20, 10))):
        actions = np.random.default_rng(0).integers(1, 5, count)
        start = time.perf_counter()
        for action in actions:
            env.step(int(action), observation_mode=mode)
        rates.append(count / (time.perf_counter() - start))
    return rates[0], rates[1], reset_rate


def gymnasium_frozen_lake_rate(num_steps: int) -> float:
    env = gymnasium.make("FrozenLake-v1", map_name="4x4", is_slippery=True).unwrapped
    env.reset(seed=0)
    actions = np.random.default_rng(0).integers(0, 4, num_steps)
    start = time.perf_counter()
    for action in actions:
        _, _, terminated, _, _ = env.step(int(action))
        if terminated:
            env.reset()
    return num_steps / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 1024, 8192])
    parser.add_argument("--steps", type=int, default=100, help="steps per timed rollout of ours")
    parser.add_argument("--peer-steps", type=int, default=2000, help="steps timed for each peer")
    parser.add_argument("--peer-resets", type=int, default=100, help="gym-sokoban resets timed")
    hygiene.add_threads_argument(parser)
    args = parser.parse_args()
    hygiene.start(args.threads)

    gym_step, ragen_step, gym_reset = gym_sokoban_rates(args.peer_steps, args.peer_resets)
    lake_peer = gymnasium_frozen_lake_rate(args.peer_steps)
    sokoban, frozen_lake = envs.make("SimpleSokoban"), envs.make("FrozenLake")
    print(f"backend: {jax.default_backend()}  devices: {jax.device_count()}")
    print(f"peers: gym-sokoban {gym_step:,.0f} steps/s ({ragen_step:,.1f} as RAGEN calls it), "
          f"{gym_reset:,.1f} levels/s; gymnasium FrozenLake {lake_peer:,.0f} steps/s")
    header = f"{'batch':>6} | {'Sokoban steps/s':>16} {'ratio':>8} {'vs RAGEN':>9} | {'FrozenLake steps/s':>18} " \
             f"{'ratio':>8} | {'levels/s':>10} {'ratio':>8}"
    print(header)
    print("-" * len(header))
    for batch in args.batches:
        levels, states = our_reset_rate(sokoban, batch)
        soko = our_step_rate(sokoban, states, args.steps)
        _, lake_states = jax.jit(jax.vmap(frozen_lake.reset_env, in_axes=(0, None)))(
            jax.random.split(jax.random.key(2), batch), frozen_lake.default_params)
        lake = our_step_rate(frozen_lake, lake_states, args.steps)
        print(f"{batch:>6} | {soko:>16,.0f} {soko / gym_step:>7.1f}x {soko / ragen_step:>8.0f}x | "
              f"{lake:>18,.0f} {lake / lake_peer:>7.1f}x | "
              f"{levels:>10,.1f} {levels / gym_reset:>7.1f}x", flush=True)


if __name__ == "__main__":
    main()
