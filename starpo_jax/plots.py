"""The Echo Trap panel of RAGEN (Fig. 4 / §4.1) drawn from a run's ``metrics.jsonl``.

Panels: success per environment (training rollouts, raw and EMA-smoothed as in
the paper's curves, and held-out validation),
trajectory reward mean ± std per environment, in-group reward std (all groups
and the groups StarPO-S keeps), the actor's gradient norm and its token entropy —
the signals the paper reads the collapse from (starpo.md §19) — and, when the run
logged RAGEN-2's collapse diagnostics, retrieval accuracy against its chance level and
the MI z-score against the reasoning entropy (ragen2.md §3). Written with
matplotlib's Agg backend, so no display is needed.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import numpy as np  # noqa: E402

from runtime.metrics import read_jsonl  # noqa: E402
from starpo_jax.echo_trap import COLLAPSE_FAMILIES  # noqa: E402


def series(rows: Sequence[dict[str, Any]], name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values)`` of the rows that logged ``name`` (non-finite values, stored as text, skipped)."""
    points = [(row["step"], row[name]) for row in rows if isinstance(row.get(name), (int, float))]
    steps, values = zip(*points) if points else ((), ())
    return np.asarray(steps, np.int64), np.asarray(values, np.float64)


def ema(values: np.ndarray, weight: float = 0.7) -> np.ndarray:
    """Exponential moving average ``s_t = weight · s_{t−1} + (1 − weight) · x_t``, ``s_0 = x_0`` (the paper's curves)."""
    smoothed = np.empty_like(values)
    for t, value in enumerate(values):
        smoothed[t] = value if t == 0 else weight * smoothed[t - 1] + (1 - weight) * value
    return smoothed


def env_tags(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Environment tags that logged ``train/{Tag}/success`` or ``val/{Tag}/success``, in first-seen order."""
    tags: list[str] = []
    for row in rows:
        for name in row:
            parts = name.split("/")
            if len(parts) == 3 and parts[0] in ("train", "val") and parts[2] == "success" and parts[1] not in tags:
                tags.append(parts[1])
    return tags


def plot_echo_trap(metrics_path: str | os.PathLike, png_path: str | os.PathLike, title: str = "") -> list[str]:
    """Draws the six panels of a StarPO run to ``png_path``; returns the metric names it plotted."""
    rows = read_jsonl(metrics_path)
    tags = env_tags(rows)
    families = [f for f in COLLAPSE_FAMILIES if any(f"{f}/mi_zscore_ema" in row for row in rows)]
    figure, axes = plt.subplots(2, 4 if families else 3, figsize=(20 if families else 15, 8))
    plotted: list[str] = []

    def line(ax, name, label, smooth=False, **style):
        steps, values = series(rows, name)
        if len(steps):
            drawn = ax.plot(steps, values, label=label, **{"marker": ".", "alpha": 0.35 if smooth else 1, **style})
            if smooth:
                ax.plot(steps, ema(values), color=drawn[0].get_color(), label=f"{label} (EMA)")
            plotted.append(name)
        return steps, values

    for tag in tags:
        line(axes[0, 0], f"train/{tag}/success", f"{tag} train", smooth=True)
        line(axes[0, 0], f"val/{tag}/success", f"{tag} held-out", marker="o", linestyle="--")
        steps, mean = line(axes[0, 1], f"train/{tag}/reward/mean", f"{tag} mean")
        std_steps, std = series(rows, f"train/{tag}/reward/std")
        if len(steps) and len(std_steps) == len(steps):
            axes[0, 1].fill_between(steps, mean - std, mean + std, alpha=0.2, label=f"{tag} ± std")
            plotted.append(f"train/{tag}/reward/std")
    line(axes[0, 2], "rollout/in_group_std", "all groups")
    line(axes[0, 2], "rollout/chosen_in_group_std", "kept groups")
    line(axes[1, 0], "actor/grad_norm", "actor")
    line(axes[1, 0], "critic/grad_norm", "critic")
    line(axes[1, 1], "actor/entropy_loss", "actor")
    line(axes[1, 2], "actor/pg_clipfrac", "clip fraction")
    line(axes[1, 2], "actor/ppo_kl", "approx. KL")
    titles = ["success", "trajectory reward", "in-group reward std", "gradient norm", "token entropy",
              "PPO ratio diagnostics"]
    panels = [axes[0, 0], axes[0, 1], axes[0, 2], axes[1, 0], axes[1, 1], axes[1, 2]]
    for family in families:
        label = family.removeprefix("collapse_").removesuffix("_sample").replace("_", "-")
        line(axes[0, 3], f"{family}/retrieval_accuracy", f"{label} accuracy")
        line(axes[0, 3], f"{family}/retrieval_chance_level", f"{label} chance", linestyle=":")
        line(axes[1, 3], f"{family}/mi_zscore_ema", f"{label} MI z-score (EMA)")
        line(axes[1, 3], f"{family}/conditional_entropy_est", f"{label} H(Z|X) per token", linestyle="--")
    if families:
        titles += ["prompt retrieval from reasoning", "MI z-score vs reasoning entropy"]
        panels += [axes[0, 3], axes[1, 3]]
    for ax, name in zip(panels, titles):
        ax.set_title(name)
        ax.set_xlabel("iteration")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(png_path, dpi=90)
    plt.close(figure)
    return plotted


def plot_sft(metrics_path: str | os.PathLike, png_path: str | os.PathLike) -> list[str]:
    """Loss and next-token accuracy of the supervised warm-up."""
    rows = read_jsonl(metrics_path)
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    plotted = []
    for ax, name in zip(axes, ("sft/loss", "sft/accuracy")):
        steps, values = series(rows, name)
        ax.plot(steps, values)
        ax.set_title(name)
        ax.set_xlabel("step")
        plotted.append(name)
    figure.tight_layout()
    figure.savefig(png_path, dpi=90)
    plt.close(figure)
    return plotted
