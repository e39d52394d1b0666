"""The embedded StarPO demo over several seeds: ``python -m launch.starpo --seeds 0-3x0-1``.

One run is one draw; the demo's claim is the distribution. ``--seeds PxS`` trains, for each
policy init seed ``p`` in ``P`` (``nnx.Rngs`` of the random policy, so its own tokenizer-equal
SFT model in ``<out>/policy<p>/``), each sampling seed ``s`` in ``S`` (RAGEN's ``seed.train``
= 10000 · (s + 1): other training maps and sampling keys) into ``<out>/policy<p>/sampling<s>/``.
Validation is the same held-out episodes for every run. ``<out>/summary.json`` holds every run
and, per stage, the held-out gain's mean, min and max; ``<out>/plots/seeds_<tag>.png`` shows
the per-seed curves. Finished parts are reused when rerun.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Sequence

import matplotlib.pyplot as plt
import numpy as np
from jax.sharding import Mesh

from launch.demo_starpo import DemoConfig, finish, train_stages, warm_up, with_custom_envs
from runtime.metrics import read_jsonl
from starpo_jax.config import SeedConfig
from starpo_jax.plots import ema, series


def parse_seeds(text: str) -> tuple[list[int], list[int]]:
    """``"0-3x0-1"`` -> ([0, 1, 2, 3], [0, 1]); each side a range ``a-b`` or a comma list; no ``x``: sampling 0."""
    def side(part: str) -> list[int]:
        try:
            if "-" in part:
                low, high = (int(v) for v in part.split("-"))
                values = list(range(low, high + 1))
            else:
                values = [int(v) for v in part.split(",")]
        except ValueError:
            values = []
        if not values or min(values) < 0 or len(set(values)) != len(values):
            raise ValueError(f"--seeds {text!r}: {part!r} is not a range a-b or a comma list of distinct seeds >= 0")
        return values

    policy, _, sampling = text.partition("x")
    return side(policy), side(sampling or "0")


def sampling_overrides(overrides: Sequence[str], sampling_seed: int) -> list[str]:
    """``overrides`` with ``seed.train`` set for ``sampling_seed``; a user's ``seed.train`` would be ignored: refused."""
    if any(o.split("=", 1)[0].lstrip("+") == "seed.train" for o in overrides):
        raise ValueError("--seeds sets seed.train per sampling seed; drop the seed.train override")
    return [*overrides, f"seed.train={SeedConfig().train * (sampling_seed + 1)}"]


def distribution(runs: list[dict], tags: Sequence[str]) -> dict[str, dict[str, float]]:
    """Per stage: the held-out success before / after and the gain (points), mean, min and max over runs."""
    result = {}
    for tag in tags:
        before = np.array([r[f"{tag}/success_after_sft"] for r in runs]) * 100
        after = np.array([r[f"{tag}/success_after_rl"] for r in runs]) * 100
        stats = {}
        for name, values in (("before", before), ("after", after), ("gain", after - before)):
            stats.update({f"{name}_mean": float(values.mean()), f"{name}_min": float(values.min()),
                          f"{name}_max": float(values.max())})
        result[tag] = stats
    return result


def plot_seeds(runs: list[dict], out: Path, tag: str) -> None:
    """Per-seed training success (EMA) and held-out success before / after, one colour per run."""
    figure, axis = plt.subplots(figsize=(9, 5))
    for run in runs:
        rows = read_jsonl(Path(run["folder"]) / f"rl_{tag.lower()}" / "metrics.jsonl")
        steps, values = series(rows, f"train/{tag}/success")
        label = f"policy {run['policy_seed']}, sampling {run['sampling_seed']}"
        drawn = axis.plot(steps, ema(values) * 100, label=label)
        val_steps, val = series(rows, f"val/{tag}/success")
        axis.plot(val_steps, val * 100, "o--", color=drawn[0].get_color())
    axis.set(xlabel="StarPO iteration", ylabel="success %",
             title=f"{tag}: training success (EMA, solid) and held-out success (dashed) per seed")
    axis.legend(fontsize=7)
    figure.savefig(out / "plots" / f"seeds_{tag.lower()}.png", dpi=90)
    plt.close(figure)


def run_seeds(out: Path, mesh: Mesh, preset: str, overrides: Sequence[str], config: DemoConfig,
              policy_seeds: Sequence[int], sampling_seeds: Sequence[int]) -> dict:
    """Runs the demo for every policy x sampling seed; returns and writes the summary with the distribution."""
    clock = time.perf_counter()
    overrides, custom_envs = with_custom_envs(config, overrides)
    per_seed = [sampling_overrides(overrides, s) for s in sampling_seeds]
    runs = []
    for p in policy_seeds:
        policy_config = dataclasses.replace(config, policy_seed=p)
        model_path = warm_up(policy_config, out / f"policy{p}", mesh, custom_envs)
        for s, seeded in zip(sampling_seeds, per_seed):
            folder = out / f"policy{p}" / f"sampling{s}"
            summary = train_stages(policy_config, model_path, folder, mesh, preset, seeded)
            runs.append({"policy_seed": p, "sampling_seed": s, "folder": str(folder), **summary})
    tags = [stage.tag for stage in config.stages]
    (out / "plots").mkdir(parents=True, exist_ok=True)
    for tag in tags:
        plot_seeds(runs, out, tag)
    summary = finish({"runs": runs, "distribution": distribution(runs, tags)}, out, clock)
    for run in runs:
        print(f"policy {run['policy_seed']} sampling {run['sampling_seed']}: " + ", ".join(
            f"{tag} {run[f'{tag}/success_after_sft']:.1%} -> {run[f'{tag}/success_after_rl']:.1%}" for tag in tags))
    for tag, stats in summary["distribution"].items():
        print(f"{tag:>12}: gain over {len(runs)} runs mean {stats['gain_mean']:+.1f}, min {stats['gain_min']:+.1f}, "
              f"max {stats['gain_max']:+.1f} points (after SFT {stats['before_mean']:.1f} %, after StarPO-S "
              f"{stats['after_mean']:.1f} %)")
    print(f"wall time {summary['wall_time_s']:.0f} s (load average {summary['load_average_1min']:.1f} on "
          f"{os.cpu_count()} cores); per-seed plots in {out / 'plots'}")
    return summary
