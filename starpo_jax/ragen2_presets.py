"""RAGEN-2's task configs (``config/_2_sokoban.yaml`` … ``_10_rubikscube.yaml``, ragen2.md §7-8) as presets.

Each set is the V2 base's agent limits (``max_turn`` 5, ``max_actions_per_turn`` 2) and RAGEN-2's prompt layout
(``agent_proxy.prompt_layout=v2``; ``context_window_mode`` stays ``full``) plus the task's own keys;
``starpo_jax.presets`` composes them with an algorithm as ``v2-{task}-{algorithm}``. ``max_context_window``
settings of the 2048 and cube configs are left out: under ``context_window_mode: full`` they have no effect
(ragen2.md §7.3). Service tasks (WebShop, search, Lean, DeepCoder) need their data or servers and have no
preset.

``V2_DEFAULTS`` is the switch from RAGEN's V1 (paper) defaults, which the config's own defaults are, to RAGEN-2's
(``config/base.yaml`` at V2, ragen2.md §6.9): ``ragen_version=v2`` (GRPO per group in the trainer, GAE over
response positions), the no-op top-p filter, collapse detection and early stops. Its ``loss_agg_mode: token-mean`` at
micro-batch 1 averages each sequence's token mean (ragen2.md §6.3): here the aggregation spans the mini-batch
whatever the micro-batch, so that is ``seq-mean-token-mean``, the V1 default, which the switch keeps.
On it: the main table's algorithm rows ``v2-{task}-{ppo,dapo,grpo,drgrpo}-{filter,nofilter}`` (§9.1), the
intervention sweeps ``v2-sokoban-topp{p}[-nofilter]``, ``v2-sokoban-kl{coef}[-nozero]``, ``v2-sokoban-entropy{coef}``
(§9.2) and the FrozenLake slipper sweep ``v2-frozenlake-slipper{rate}-{filter,nofilter}`` (§7.2).
"""

from __future__ import annotations

from typing import Mapping

import dataclasses

from envs.coord import slipper_success_rate
from envs.registry import RAGEN2_ENVS, EnvEntry
from runtime.preset import Preset


def define_tags(entries: Mapping[str, EnvEntry]) -> Preset:
    """A preset adding ``entries`` to ``custom_envs``."""
    return Preset({f"custom_envs.{tag}": entry for tag, entry in entries.items()})


def with_env_config(tag: str, **env_config) -> Preset:
    """``custom_envs.<tag>`` (a RAGEN-2 tag) with ``env_config`` keys changed."""
    entry = RAGEN2_ENVS[tag]
    return Preset({f"custom_envs.{tag}": dataclasses.replace(entry, env_config={**entry.env_config, **env_config})})


# Every RAGEN-2 preset defines all of RAGEN-2's new tags (``launch.evaluate --envs`` may name any of them).
V2_BASE = define_tags(RAGEN2_ENVS) + Preset({"agent_proxy.max_turn": 5, "agent_proxy.max_actions_per_turn": 2,
                                             "agent_proxy.prompt_layout": "v2"})


def tags(*names: str) -> Preset:
    """Train and validate on the ``custom_envs`` tags ``names``."""
    return Preset({"es_manager.train.env_configs.tags": names, "es_manager.val.env_configs.tags": names})


TASKS: dict[str, Preset] = {
    "sokoban": V2_BASE + tags("CoordSokoban"),
    "frozenlake": V2_BASE + tags("CoordFrozenLake") + with_env_config("CoordFrozenLake", success_rate=1.0),
    "countdown": V2_BASE + Preset({"agent_proxy.max_turn": 1}) + tags("Countdown"),
    "metamathqa": V2_BASE + tags("MetamathQA"),
    "sudoku": V2_BASE + tags("SimpleSudoku") + Preset({
        "es_manager.train.env_groups": 8, "es_manager.train.group_size": 16, "es_manager.train.env_configs.n_groups": (8,),
        "es_manager.val.env_groups": 32, "es_manager.val.group_size": 16, "es_manager.val.env_configs.n_groups": (32,)}),
    "2048": V2_BASE + tags("game_2048") + Preset({
        "agent_proxy.max_turn": 800, "agent_proxy.max_actions_per_turn": 1,
        "actor_rollout_ref.rollout.max_model_len": 8192, "actor_rollout_ref.rollout.response_length": 256}),
    "rubikscube": V2_BASE + tags("rubikscube") + Preset({
        "agent_proxy.max_turn": 25, "agent_proxy.max_actions_per_turn": 4,
        "actor_rollout_ref.rollout.response_length": 500, "actor_rollout_ref.rollout.val_kwargs.temperature": 0.5}),
}
ROLLOUT = "actor_rollout_ref.rollout."
ACTOR = "actor_rollout_ref.actor."
# RAGEN-2's base.yaml where it differs from the V1 defaults (the rollout filter keys at their V2 values: no filtering).
V2_DEFAULTS = Preset({
    "ragen_version": "v2", "model_path": "Qwen/Qwen2.5-3B-Instruct", ROLLOUT + "rollout_filter_strategy": "top_p",
    ROLLOUT + "rollout_filter_value": 1.0, ROLLOUT + "rollout_filter_type": "largest",
    ROLLOUT + "rollout_filter_include_zero": True, ROLLOUT + "rollout_filter_top_p_prob_mode": "linear",
    "collapse_detection.first_turn_enabled": True, "collapse_detection.multi_turn_enabled": True,
    "trainer.project_name": "ragen", "trainer.save_freq": 100, "trainer.early_stop_reward_variance_collapse": True,
    "trainer.early_stop_low_validation_success": True, "es_manager.val.env_groups": 512, "es_manager.val.group_size": 1,
    "es_manager.val.env_configs.n_groups": (512,)})


def top_p(p: float, mode: str = "softmax", include_zero: bool = True) -> Preset:
    """RAGEN-2's top-p group filter (``largest``, ``reward_variance``) with keep-probability ``p``."""
    return Preset({ROLLOUT + "rollout_filter_value": float(p), ROLLOUT + "rollout_filter_top_p_prob_mode": mode,
                   ROLLOUT + "rollout_filter_include_zero": include_zero})


# The main table's runs (run_main_table_diff_algo.sh): base-model name, 400 steps, softmax top-p 0.9 ("filter") or
# 1.0 ("nofilter") keeping zero-variance groups, KL loss off, entropy 0.001. Their micro-batch was 4 (V2-REL), so
# ``token-mean`` averaged tokens over 4 sequences; here it averages over the mini-batch (README, RAGEN-2 section).
MAIN_TABLE = Preset({"model_path": "Qwen/Qwen2.5-3B", "trainer.total_training_steps": 400,
                     "trainer.val_before_train": True, "trainer.save_freq": -1, ACTOR + "use_kl_loss": False,
                     ACTOR + "kl_loss_coef": 0.001, ACTOR + "entropy_coeff": 0.001, ACTOR + "filter_loss_scaling": "none"})
PPO = Preset({"algorithm.adv_estimator": "gae", ACTOR + "loss_agg_mode": "token-mean"})
# RAGEN-2's DAPO row restates the defaults (clip 0.2 / 0.28, no KL anywhere): it is PPO (ragen2.md §9.1, derived).
DAPO = PPO + Preset({ACTOR + "clip_ratio_low": 0.2, ACTOR + "clip_ratio_high": 0.28, ACTOR + "use_kl_loss": False,
                     ACTOR + "kl_loss_coef": 0.0, "algorithm.use_kl_in_reward": False, "algorithm.kl_ctrl.kl_coef": 0.0})
GRPO = Preset({"algorithm.adv_estimator": "grpo", "algorithm.norm_adv_by_std_in_grpo": True,
               ACTOR + "loss_agg_mode": "seq-mean-token-mean"})
DR_GRPO = Preset({"algorithm.adv_estimator": "grpo", "algorithm.norm_adv_by_std_in_grpo": False,
                  ACTOR + "loss_agg_mode": "seq-mean-token-sum"})
V2_ALGORITHMS = {"ppo": PPO, "dapo": DAPO, "grpo": GRPO, "drgrpo": DR_GRPO}
MAIN_TABLE_TASKS = ("sokoban", "frozenlake", "metamathqa", "countdown")  # WebShop needs its service
MAIN_TABLE_PRESETS: dict[str, Preset] = {
    f"v2-{task}-{name}-{arm}": V2_DEFAULTS + TASKS[task] + MAIN_TABLE + algorithm + top_p(p)
    for task in MAIN_TABLE_TASKS for name, algorithm in V2_ALGORITHMS.items()
    for arm, p in (("filter", 0.9), ("nofilter", 1.0))}

# The intervention sweeps (docs/experiment_intervention_sweep.md): Sokoban, PPO, 400 steps.
SWEEP = V2_DEFAULTS + TASKS["sokoban"] + MAIN_TABLE + PPO
TOP_P_VALUES = (1.0, 0.98, 0.95, 0.9, 0.8, 0.6, 0.4)
COEFFICIENTS = (0, 0.001, 0.003, 0.01, 0.03, 0.1)


def kl_loss(coef: float) -> Preset:
    """The KL loss (k1) at ``coef``; off at 0, as the sweep scripts switch it."""
    return Preset({ACTOR + "use_kl_loss": coef > 0, ACTOR + "kl_loss_coef": float(coef)})


SWEEP_PRESETS: dict[str, Preset] = {
    **{f"v2-sokoban-topp{p:g}": SWEEP + kl_loss(0.001) + top_p(p, include_zero=False) for p in TOP_P_VALUES},
    "v2-sokoban-topp-nofilter": SWEEP + kl_loss(0.001) + top_p(1.0),
    **{f"v2-sokoban-kl{c:g}{arm}": SWEEP + Preset({ACTOR + "entropy_coeff": 0.0}) + kl_loss(c) + top_p(1.0, include_zero=zero)
       for c in COEFFICIENTS for arm, zero in (("", True), ("-nozero", False))},
    **{f"v2-sokoban-entropy{c:g}": SWEEP + kl_loss(0) + Preset({ACTOR + "entropy_coeff": float(c)}) + top_p(1.0)
       for c in COEFFICIENTS},
}
SLIPPER_RATES = (100, 50, 20, 10, 5, 2, 0)


def slipper_sweep(rate) -> Preset:
    """One sweep run: CoordFrozenLake with ``success_rate = 1 - rate``, GAE, no entropy bonus or KL, 400 steps."""
    return V2_DEFAULTS + V2_BASE + tags("CoordFrozenLake") + with_env_config(
        "CoordFrozenLake", success_rate=slipper_success_rate(rate)) + Preset({
            "model_path": "Qwen/Qwen2.5-3B", "algorithm.adv_estimator": "gae",
            ACTOR + "entropy_coeff": 0.0, ACTOR + "use_kl_loss": False, ACTOR + "kl_loss_coef": 0.0,
            "trainer.total_training_steps": 400})


# Each rate in both modes: softmax top-p 0.9 without zero-variance groups ("filter") or 1.0 with them ("nofilter").
SLIPPER_PRESETS: dict[str, Preset] = {
    f"v2-frozenlake-slipper{rate}-{arm}": slipper_sweep(rate) + top_p(p, include_zero=arm == "nofilter")
    for rate in SLIPPER_RATES for arm, p in (("filter", 0.9), ("nofilter", 1.0))}
V2_PRESETS: dict[str, Preset] = {"v2": V2_DEFAULTS + TASKS["sokoban"] + Preset({"algorithm.adv_estimator": "gae"}), **MAIN_TABLE_PRESETS, **SWEEP_PRESETS,
                                 **SLIPPER_PRESETS}
