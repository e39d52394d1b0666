"""Checks that generated Sokoban levels are solvable: generate N per size, solve each with BFS.

    python -m bench.validate_sokoban [--num-levels 10000] [--chunk 1000] [--tags SimpleSokoban LargerSokoban]

Reports, per tag, how many levels the BFS solver solves, how many used the fixed fallback room
(every try scored 0) and the distribution of shortest solution lengths.
"""

import argparse
import time

import jax
import numpy as np

from bench import hygiene
import envs
from envs.solvers import solve_sokoban
from envs.sokoban_generation import generate_level


def validate(tag: str, num_levels: int, chunk: int, seed: int) -> None:
    env = envs.make(tag)
    generate = jax.jit(jax.vmap(lambda key: generate_level(key, env.generator)))
    solved, fallback, lengths = 0, 0, []
    start = time.perf_counter()
    for first in range(0, num_levels, chunk):
        keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), first), chunk)
        levels = jax.device_get(generate(keys))
        for i in range(min(chunk, num_levels - first)):
            solution = solve_sokoban(levels.room_fixed[i], levels.room_state[i])
            fallback += int(levels.score[i] <= 0)
            if solution:
                solved += 1
                lengths.append(len(solution))
    seconds = time.perf_counter() - start
    histogram = {length: int(count) for length, count in enumerate(np.bincount(lengths)) if count}
    print(f"{tag}: {solved}/{num_levels} solvable, {fallback} fallback rooms, {seconds:.0f}s "
          f"(generation + BFS); shortest solution lengths {histogram}", flush=True)
    if solved != num_levels:
        raise SystemExit(f"{tag}: {num_levels - solved} unsolvable levels")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-levels", type=int, default=10_000)
    parser.add_argument("--chunk", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tags", nargs="+", default=["SimpleSokoban", "LargerSokoban", "SokobanDifferentGridVocab"])
    hygiene.add_threads_argument(parser)
    args = parser.parse_args()
    hygiene.start(args.threads)
    for tag in args.tags:
        validate(tag, args.num_levels, args.chunk, args.seed)


if __name__ == "__main__":
    main()
