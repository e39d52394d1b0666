"""Sokoban level difficulty: our generators against the reference's, on the same number of levels.

    python -m bench.bench_sokoban_levels [--num-levels 2000] [--tags SimpleSokoban LargerSokoban]
                                         [--ragen-utils PATH/TO/ragen/env/sokoban/utils.py]

Per tag it draws levels from the environment (``generator=reverse_play``, the default, and the
on-device ``pull_walk``), from gym-sokoban's ``generate_room`` (its own search depth, 300) and,
with ``--ragen-utils``, from RAGEN's ``generate_room`` loaded from a local copy of that file (seeded
as RAGEN's ``all_seed``). For each it prints the histograms of the optimal solution length (BFS)
and of the box displacement (least total Manhattan distance from the boxes to the targets), and
two-sample Kolmogorov-Smirnov p-values of each against the reference generators.
"""

import argparse
import importlib.util
import itertools
import random
import time
import warnings

import jax
import numpy as np
from scipy.stats import ks_2samp

from bench import hygiene
import envs
from envs.solvers import solve_sokoban


def features(room_fixed, room_state) -> tuple[int, int]:
    """(optimal solution length, box displacement) of one level."""
    fixed, state = np.asarray(room_fixed), np.asarray(room_state)
    boxes, targets = np.argwhere(np.isin(state, (3, 4))), np.argwhere(fixed == 2)
    displacement = min(np.abs(boxes - targets[list(order)]).sum() for order in itertools.permutations(range(len(targets))))
    return len(solve_sokoban(fixed, state)), int(displacement)


def environment_levels(tag: str, count: int, generator: str):
    env = envs.make(tag, generator=generator)
    keys = jax.random.split(jax.random.key(0), count)
    _, states = jax.jit(jax.vmap(env.reset_env, in_axes=(0, None)))(keys, env.default_params)
    states = jax.device_get(states)
    return [(states.room_fixed[i], states.room_state[i]) for i in range(count)]


def seeded_levels(generate, count: int, **kwargs):
    """Levels of a global-RNG generator, seeds 0, 1, …; a seed that raises is replaced by the next unused one."""
    levels, seed = [], 0
    while len(levels) < count:
        random.seed(seed)
        np.random.seed(seed)
        seed += 1
        try:
            room_fixed, room_state, *_ = generate(**kwargs)
        except (RuntimeError, RuntimeWarning):
            continue
        levels.append((room_fixed, room_state))
    return levels


def histogram(values) -> str:
    return " ".join(f"{v}:{c}" for v, c in sorted(zip(*np.unique(values, return_counts=True))))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-levels", type=int, default=2000)
    parser.add_argument("--tags", nargs="+", default=["SimpleSokoban", "LargerSokoban"])
    parser.add_argument("--ragen-utils", help="a local copy of RAGEN's ragen/env/sokoban/utils.py")
    hygiene.add_threads_argument(parser)
    args = parser.parse_args()
    hygiene.start(args.threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from gym_sokoban.envs.room_utils import generate_room as gym_generate_room
    ragen_generate_room = None
    if args.ragen_utils:
        spec = importlib.util.spec_from_file_location("ragen_sokoban_utils", args.ragen_utils)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        ragen_generate_room = module.generate_room
    for tag in args.tags:
        env = envs.make(tag)
        dim, boxes, depth = env.dim_room, env.num_boxes, env.generator.search_depth
        common = dict(dim=dim, num_steps=int(1.7 * sum(dim)), num_boxes=boxes)
        sources = {"ours reverse_play": lambda: environment_levels(tag, args.num_levels, "reverse_play"),
                   "ours pull_walk": lambda: environment_levels(tag, args.num_levels, "pull_walk"),
                   "gym-sokoban": lambda: seeded_levels(gym_generate_room, args.num_levels, **common)}
        if ragen_generate_room:
            sources["RAGEN"] = lambda: seeded_levels(ragen_generate_room, args.num_levels, search_depth=depth, **common)
        results = {}
        for name, draw in sources.items():
            start = time.perf_counter()
            levels = draw()
            generated = time.perf_counter() - start
            results[name] = np.array([features(*level) for level in levels])
            print(f"{tag} {name}: {len(levels)} levels, generated in {generated:.1f} s", flush=True)
            print(f"  solution length {histogram(results[name][:, 0])}", flush=True)
            print(f"  box displacement {histogram(results[name][:, 1])}", flush=True)
        for name in results:
            for reference in ("gym-sokoban", "RAGEN"):
                if reference in results and reference != name:
                    print(f"{tag} {name} vs {reference}: KS p solution length "
                          f"{ks_2samp(results[name][:, 0], results[reference][:, 0]).pvalue:.3g}, box displacement "
                          f"{ks_2samp(results[name][:, 1], results[reference][:, 1]).pvalue:.3g}", flush=True)


if __name__ == "__main__":
    main()
