"""Named StarPO algorithms and RAGEN's paper runs as compositions of typed presets (starpo.md §12, §17).

A ``runtime.preset.Preset`` maps config key paths to typed values; ``a + b`` applies ``a`` then ``b``
(the mechanism TDD's presets share). The flag sets are those of RAGEN's ``train_all.sh`` (``USE_PPO``,
``USE_GRPO``, ``USE_BASE``);
StarPO-S is the default config, vanilla StarPO adds ``USE_BASE``, and the paper's ablations
add one more flag set each. A paper recipe is an environment flag set (RAGEN's
``_1_bandit`` / ``_2_sokoban`` / ``_3_frozen_lake`` / ``_4_countdown`` configs) followed by an
algorithm, named ``{env}-{algorithm}``; the rollout-shaping studies of starpo.md §17 are named
``sokoban-pxn-{P}x{N}``, ``sokoban-actions{k}`` and ``sokoban-online{k}``, the generalisation
runs of starpo.md §14.1 and Table 4 ``sokoban-generalization*`` and ``bandit-generalization*``. ``load_config``
resolves a preset plus user overrides into a validated ``StarPOConfig``; ``parse_args`` does the
same for a command line in RAGEN's form ``--preset starpo-s-grpo actor_rollout_ref.actor.clip_ratio_high=0.2 ...``.
``MESH_PRESETS`` names the ``--mesh`` value (data, fsdp, tensor) for common accelerators.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Sequence

from runtime.config import split_section
from runtime.mesh import MeshConfig
from runtime.preset import Preset, build_config
from starpo_jax.config import StarPOConfig, resolve
from starpo_jax.config_checks import validate
from starpo_jax.custom_envs import SECTION, apply_overrides
from starpo_jax.ragen2_presets import TASKS, V2_PRESETS

USE_PPO = Preset({"algorithm.adv_estimator": "gae"})
USE_GRPO = Preset({"algorithm.adv_estimator": "grpo", "agent_proxy.reward_normalization.method": "mean_std",
                   "actor_rollout_ref.actor.use_kl_loss": True})
USE_BASE = Preset({"algorithm.kl_ctrl.kl_coef": 0.001, "actor_rollout_ref.actor.kl_loss_coef": 0.001,
                   "actor_rollout_ref.actor.clip_ratio_high": 0.2, "actor_rollout_ref.rollout.rollout_filter_ratio": 1.0})
# PAPER applied KL-in-reward whenever use_kl_loss was False (starpo.md §22.8): vanilla PPO runs had it.
PAPER_KL_IN_REWARD = Preset({"algorithm.use_kl_in_reward": True})
CLIP_HIGHER = Preset({"actor_rollout_ref.actor.clip_ratio_high": 0.28})
NO_KL = Preset({"algorithm.kl_ctrl.kl_coef": 0.0, "actor_rollout_ref.actor.kl_loss_coef": 0.0})
USE_LORA = Preset({"lora.rank": 64, "lora.alpha": 64, "actor_rollout_ref.actor.optim.lr": 1e-5,
                   "critic.optim.lr": 1e-4})
# RAGEN README's recipe for GPUs smaller than an 80 GB A100 (e.g. a 24 GB RTX 4090), starpo.md §16.
LOW_MEMORY = Preset({"micro_batch_size_per_gpu": 1, "ppo_mini_batch_size": 8,
                     "actor_rollout_ref.rollout.max_model_len": 2048, "actor_rollout_ref.rollout.response_length": 128})
NO_THINK = Preset({"agent_proxy.enable_think": False})
TINY = Preset({"es_manager.train.env_groups": 4, "es_manager.train.group_size": 4,
               "es_manager.train.env_configs.n_groups": (4,), "es_manager.val.env_groups": 8,
               "es_manager.val.env_configs.n_groups": (8,), "ppo_mini_batch_size": 4, "micro_batch_size_per_gpu": 2,
               "actor_rollout_ref.rollout.rollout_filter_ratio": 0.5, "actor_rollout_ref.rollout.response_length": 32,
               "actor_rollout_ref.rollout.max_model_len": 512, "agent_proxy.max_turn": 2,
               "trainer.total_training_steps": 2, "trainer.test_freq": 1})


def env_tags(train: tuple[str, ...], val: tuple[str, ...] | None = None) -> Preset:
    """Train (and validate, by default on the same) on these ``custom_envs`` tags."""
    return Preset({"es_manager.train.env_configs.tags": train, "es_manager.val.env_configs.tags": val or train})


SINGLE_TURN = Preset({"agent_proxy.max_turn": 1, "agent_proxy.max_actions_per_turn": 1})
# RAGEN's per-environment configs (config/_1_bandit.yaml ... _4_countdown.yaml; starpo.md §14).
BANDIT = SINGLE_TURN + env_tags(("Bandit",), ("Bandit", "BanditTest")) + Preset({
    "actor_rollout_ref.rollout.response_length": 500, "es_manager.val.env_groups": 512,
    "es_manager.val.env_configs.n_groups": (256, 256)})
SOKOBAN = env_tags(("SimpleSokoban",))
FROZEN_LAKE = env_tags(("FrozenLake",))
COUNTDOWN = SINGLE_TURN + env_tags(("Countdown",))
ENVIRONMENTS: dict[str, Preset] = {"bandit": BANDIT, "sokoban": SOKOBAN, "frozenlake": FROZEN_LAKE,
                                   "countdown": COUNTDOWN}
# train_all.sh's SOKOBAN_GENERALIZATION_CONFIG: validate on 128 states of each of four variants.
SOKOBAN_GENERALIZATION_TAGS = ("SimpleSokoban", "LargerSokoban", "SokobanDifferentGridVocab", "FrozenLake")
SOKOBAN_GENERALIZATION = SOKOBAN + Preset({
    "es_manager.val.env_groups": 512, "es_manager.val.group_size": 1,
    "es_manager.val.env_configs.tags": SOKOBAN_GENERALIZATION_TAGS, "es_manager.val.env_configs.n_groups": (128,) * 4})


def bandit_arms(train: tuple[str, str], test: tuple[str, str]) -> Preset:
    """The (low, high) arm names of the ``Bandit`` training tag and the ``BanditTest`` validation tag."""
    return Preset({f"custom_envs.{tag}.env_config.{arm}_arm_name": name
                   for tag, names in (("Bandit", train), ("BanditTest", test)) for arm, name in zip(("lo", "hi"), names)})


# train_all.sh's Bandit generalisation runs (starpo.md §14.1): train on Engineer / Teacher, validate on
# Trader / Librarian; the "Rev" runs swap low and high arm in both.
BANDIT_GENERALIZATION = BANDIT + bandit_arms(("Engineer", "Teacher"), ("Trader", "Librarian"))
BANDIT_GENERALIZATION_REV = BANDIT + bandit_arms(("Teacher", "Engineer"), ("Librarian", "Trader"))


def filter_ratio(ratio: float) -> Preset:
    """Keeps the top ``ratio`` of groups by reward std (Fig. 7 ablation)."""
    return Preset({"actor_rollout_ref.rollout.rollout_filter_ratio": float(ratio)})


def groups(env_groups: int, group_size: int) -> Preset:
    """``env_groups`` initial states (P) × ``group_size`` rollouts each (N), one env tag (Table 2).

    A group of one rollout has no reward std to rank by, so P × 1 keeps every group.
    """
    keep_all = filter_ratio(1) if group_size == 1 else Preset()
    return Preset({"es_manager.train.env_groups": env_groups, "es_manager.train.group_size": group_size,
                   "es_manager.train.env_configs.n_groups": (env_groups,)}) + keep_all


def actions_per_turn(k: int) -> Preset:
    """At most ``k`` actions per turn and ``5 k`` per trajectory in every environment of the run (Table 3)."""
    return Preset({"agent_proxy.max_actions_per_turn": k, **{
        f"custom_envs.{tag}.max_actions_per_traj": 5 * k for tag in SOKOBAN_GENERALIZATION_TAGS}})


def online(k: int) -> Preset:
    """Online-k: each rollout batch feeds k mini-batch updates (Fig. 10; ``train_all.sh``)."""
    env_groups, steps, test_freq = {1: (8, 200, 10), 2: (16, 100, 5), 5: (40, 40, 2), 10: (80, 80, 1)}[k]
    return groups(env_groups, 16) + Preset({"trainer.total_training_steps": steps, "trainer.test_freq": test_freq})


STARPO_PPO = USE_PPO + USE_BASE + PAPER_KL_IN_REWARD
FILTER_RATIOS = (0.25, 0.5, 0.75, 1.0)
ALGORITHMS: dict[str, Preset] = {
    "starpo-s-ppo": USE_PPO,
    "starpo-s-grpo": USE_GRPO,
    "starpo-ppo": STARPO_PPO,
    "starpo-grpo": USE_GRPO + USE_BASE,
    "starpo-ppo-cliphigh": STARPO_PPO + CLIP_HIGHER,
    "starpo-ppo-nokl": STARPO_PPO + NO_KL,
    **{f"starpo-s-ppo-filter{ratio:g}": USE_PPO + filter_ratio(ratio) for ratio in FILTER_RATIOS},
    **{f"starpo-s-grpo-filter{ratio:g}": USE_GRPO + filter_ratio(ratio) for ratio in FILTER_RATIOS},
    "starpo-s-ppo-lora": USE_PPO + USE_LORA,
    "starpo-s-ppo-24gb": USE_PPO + USE_LORA + LOW_MEMORY,
}
# Every environment gets the four algorithms and the LoRA / 24 GB variants; the ablations (starpo.md §12, Figs. 7-8)
# ran on Sokoban and FrozenLake.
MAIN_ALGORITHMS = ("starpo-ppo", "starpo-grpo", "starpo-s-ppo", "starpo-s-grpo", "starpo-s-ppo-lora",
                   "starpo-s-ppo-24gb")
ABLATION_ENVIRONMENTS = ("sokoban", "frozenlake")
PAPER_RECIPES: dict[str, Preset] = {
    **{f"{env}-{name}": flags + ALGORITHMS[name] for env, flags in ENVIRONMENTS.items() for name in MAIN_ALGORITHMS},
    **{f"{env}-{name}": ENVIRONMENTS[env] + algorithm for env in ABLATION_ENVIRONMENTS
       for name, algorithm in ALGORITHMS.items() if name not in MAIN_ALGORITHMS},
    "sokoban-generalization": SOKOBAN_GENERALIZATION + USE_PPO,
    "sokoban-generalization-nothink": SOKOBAN_GENERALIZATION + USE_PPO + NO_THINK,
    "bandit-generalization": BANDIT_GENERALIZATION + USE_PPO,
    "bandit-generalization-nothink": BANDIT_GENERALIZATION + USE_PPO + NO_THINK,
    "bandit-generalization-rev": BANDIT_GENERALIZATION_REV + USE_PPO,
    "bandit-generalization-rev-nothink": BANDIT_GENERALIZATION_REV + USE_PPO + NO_THINK,
    **{f"sokoban-pxn-{p}x{n}": SOKOBAN_GENERALIZATION + USE_PPO + groups(p, n)
       for p, n in ((4, 32), (8, 16), (16, 8), (32, 4), (64, 2), (128, 1))},
    **{f"sokoban-actions{k}": SOKOBAN_GENERALIZATION + USE_PPO + actions_per_turn(k) for k in range(1, 8)},
    **{f"sokoban-online{k}": SOKOBAN_GENERALIZATION + USE_PPO + online(k) for k in (1, 2, 5, 10)},
}
PRESETS: dict[str, Preset] = {**ALGORITHMS, "tiny": USE_PPO + TINY, **PAPER_RECIPES}
# RAGEN-2's task configs with each V1 algorithm; RAGEN-2's own runs on its defaults (starpo_jax.ragen2_presets).
PRESETS.update({f"v2-{task}-{name}": task_preset + ALGORITHMS[name] for task, task_preset in TASKS.items()
                for name in MAIN_ALGORITHMS})
PRESETS.update(V2_PRESETS)

# ``--mesh`` values (data, fsdp, tensor). Data-parallel devices (data × fsdp) × micro_batch_size_per_gpu
# must divide ppo_mini_batch_size (32): 16 chips therefore split 8-way FSDP × 2-way tensor parallel.
MESH_PRESETS: dict[str, MeshConfig] = {
    "gpu": MeshConfig(1, 1, 1),
    "gpu-8": MeshConfig(1, 8, 1),
    "v4-8": MeshConfig(1, 4, 1),
    "v5e-8": MeshConfig(1, 8, 1),
    "v4-32": MeshConfig(1, 8, 2),
}


def mesh_config(value: str) -> MeshConfig:
    """A ``MESH_PRESETS`` name or ``"data,fsdp,tensor"`` sizes (one may be -1) as a ``MeshConfig``."""
    if value in MESH_PRESETS:
        return MESH_PRESETS[value]
    if "," not in value:
        raise ValueError(f"--mesh must be one of {sorted(MESH_PRESETS)} or three sizes 'data,fsdp,tensor', "
                         f"got {value!r}")
    return MeshConfig.parse(value)


def load_config(preset: str = "starpo-s-ppo", overrides: Sequence[str] = ()) -> StarPOConfig:
    """The named preset with ``overrides`` (RAGEN ``key=value`` or tyro ``--key value``) on top.

    Overrides are parsed by ``runtime.config.parse_config``, which exits with a message naming
    the field for unknown keys or ill-typed values; ``custom_envs.*`` keys by
    ``starpo_jax.custom_envs.apply_overrides``, which raises a ValueError naming the key. The
    result is resolved and validated.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    env_overrides, rest = split_section(overrides, SECTION)
    config = build_config(StarPOConfig, PRESETS[preset], rest, description=f"StarPO configuration, preset {preset}")
    config = dataclasses.replace(config, custom_envs=apply_overrides(config.custom_envs, env_overrides))
    return validate(resolve(config))


def parse_args(argv: Sequence[str] | None = None) -> StarPOConfig:
    """Command line ``[--preset NAME] [dotted.key=value ...]`` to a validated config."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--preset", default="starpo-s-ppo", choices=sorted(PRESETS))
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    return load_config(args.preset, overrides)
