"""Named StarPO algorithms as compositions of RAGEN ``key=value`` overrides (spec §12, §17).

The flag sets are those of RAGEN's ``train_all.sh`` (``USE_PPO``, ``USE_GRPO``, ``USE_BASE``);
StarPO-S is the default config, vanilla StarPO adds ``USE_BASE``, and the paper's ablations
add one more flag set each. ``load_config`` resolves a preset plus user overrides into a
validated ``StarPOConfig``; ``parse_args`` does the same for a command line in RAGEN's
form ``--preset starpo-s-grpo actor_rollout_ref.actor.clip_ratio_high=0.2 ...``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from runtime.config import parse_config
from starpo_jax.config import StarPOConfig, resolve, validate

USE_PPO = ("algorithm.adv_estimator=gae",)
USE_GRPO = ("algorithm.adv_estimator=grpo", "agent_proxy.reward_normalization.method=mean_std",
            "actor_rollout_ref.actor.use_kl_loss=True")
USE_BASE = ("algorithm.kl_ctrl.kl_coef=0.001", "actor_rollout_ref.actor.kl_loss_coef=0.001",
            "actor_rollout_ref.actor.clip_ratio_high=0.2", "actor_rollout_ref.rollout.rollout_filter_ratio=1")
# PAPER applied KL-in-reward whenever use_kl_loss was False (decision 8): vanilla PPO runs had it.
PAPER_KL_IN_REWARD = ("algorithm.use_kl_in_reward=True",)
CLIP_HIGHER = ("actor_rollout_ref.actor.clip_ratio_high=0.28",)
NO_KL = ("algorithm.kl_ctrl.kl_coef=0.0", "actor_rollout_ref.actor.kl_loss_coef=0.0")
USE_LORA = ("lora.rank=64", "lora.alpha=64", "actor_rollout_ref.actor.optim.lr=1e-5", "critic.optim.lr=1e-4")
TINY = ("es_manager.train.env_groups=4", "es_manager.train.group_size=4", "es_manager.train.env_configs.n_groups=[4]",
        "es_manager.val.env_groups=8", "es_manager.val.env_configs.n_groups=[8]", "ppo_mini_batch_size=4",
        "micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.rollout_filter_ratio=0.5",
        "actor_rollout_ref.rollout.response_length=32", "actor_rollout_ref.rollout.max_model_len=512",
        "agent_proxy.max_turn=2", "trainer.total_training_steps=2", "trainer.test_freq=1")


def filter_ratio(ratio: float) -> tuple[str, ...]:
    """Flag set keeping the top ``ratio`` of groups by reward std (Fig. 7 ablation)."""
    return (f"actor_rollout_ref.rollout.rollout_filter_ratio={ratio}",)


STARPO_PPO = USE_PPO + USE_BASE + PAPER_KL_IN_REWARD
PRESETS: dict[str, tuple[str, ...]] = {
    "starpo-s-ppo": USE_PPO,
    "starpo-s-grpo": USE_GRPO,
    "starpo-ppo": STARPO_PPO,
    "starpo-grpo": USE_GRPO + USE_BASE,
    "starpo-ppo-cliphigh": STARPO_PPO + CLIP_HIGHER,
    "starpo-ppo-nokl": STARPO_PPO + NO_KL,
    **{f"starpo-s-ppo-filter{ratio:g}": USE_PPO + filter_ratio(ratio) for ratio in (0.25, 0.5, 0.75, 1.0)},
    "starpo-s-ppo-lora": USE_PPO + USE_LORA,
    "tiny": USE_PPO + TINY,
}


def load_config(preset: str = "starpo-s-ppo", overrides: Sequence[str] = ()) -> StarPOConfig:
    """The named preset with ``overrides`` (RAGEN ``key=value`` or tyro ``--key value``) on top.

    Overrides are parsed by ``runtime.config.parse_config``, which exits with a message naming
    the field for unknown keys or ill-typed values; the result is resolved and validated.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    config = parse_config(StarPOConfig, StarPOConfig(), [*PRESETS[preset], *overrides],
                          description=f"StarPO configuration, preset {preset}")
    return validate(resolve(config))


def parse_args(argv: Sequence[str] | None = None) -> StarPOConfig:
    """Command line ``[--preset NAME] [dotted.key=value ...]`` to a validated config."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--preset", default="starpo-s-ppo", choices=sorted(PRESETS))
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    return load_config(args.preset, overrides)
