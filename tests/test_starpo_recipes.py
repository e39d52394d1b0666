"""Paper recipes (starpo.md §12, §14, §17): every preset resolves and validates; key ones match it; mesh presets."""

import functools

import pytest

from runtime.mesh import MeshConfig
from starpo_jax import presets
from starpo_jax.filtering import num_kept_groups
from starpo_jax.presets import MESH_PRESETS, PAPER_RECIPES, PRESETS, mesh_config

load_config = functools.cache(presets.load_config)  # configs are frozen; each preset is parsed once per module
GENERALIZATION_VAL = ("SimpleSokoban", "LargerSokoban", "SokobanDifferentGridVocab", "FrozenLake")


def kept_mini_batches(config):
    """Optimiser steps per iteration: filtered trajectories / ppo_mini_batch_size."""
    train = config.es_manager.train
    kept = num_kept_groups(train.env_groups, config.actor_rollout_ref.rollout.rollout_filter_ratio) * train.group_size
    return kept / config.ppo_mini_batch_size


def test_every_preset_resolves_and_validates():
    failures = {}
    for name in PRESETS:
        try:
            load_config(name)
        except (ValueError, TypeError, SystemExit) as error:
            failures[name] = repr(error)
    assert not failures
    assert len(PAPER_RECIPES) == 67 and set(PAPER_RECIPES) <= set(PRESETS)


def test_environment_recipes_follow_ragen_env_configs():
    bandit = load_config("bandit-starpo-grpo")
    assert (bandit.agent_proxy.max_turn, bandit.agent_proxy.max_actions_per_turn) == (1, 1)
    assert bandit.actor_rollout_ref.rollout.response_length == 500
    assert bandit.es_manager.train.env_configs.tags == ("Bandit",)
    assert bandit.es_manager.val.env_configs.tags == ("Bandit", "BanditTest")
    assert (bandit.es_manager.val.env_groups, bandit.es_manager.val.env_configs.n_groups) == (512, (256, 256))
    assert bandit.algorithm.adv_estimator == "grpo" and bandit.actor_rollout_ref.actor.use_kl_loss
    actor = bandit.actor_rollout_ref.actor
    assert actor.kl_loss_coef == 0.001 and actor.clip_ratio_high == 0.2
    assert bandit.actor_rollout_ref.rollout.rollout_filter_ratio == 1.0
    sokoban = load_config("sokoban-starpo-s-ppo")
    assert sokoban == load_config("starpo-s-ppo")  # RAGEN's _2_sokoban is base.yaml
    frozen = load_config("frozenlake-starpo-ppo")
    assert frozen.es_manager.train.env_configs.tags == frozen.es_manager.val.env_configs.tags == ("FrozenLake",)
    assert frozen.algorithm.use_kl_in_reward and frozen.algorithm.kl_ctrl.kl_coef == 0.001
    countdown = load_config("countdown-starpo-s-grpo")
    assert (countdown.agent_proxy.max_turn, countdown.es_manager.train.env_configs.tags) == (1, ("Countdown",))
    assert countdown.actor_rollout_ref.rollout.rollout_filter_ratio == 0.25
    assert countdown.agent_proxy.reward_normalization.method == "mean_std"


def test_memory_lean_recipe_is_ragen_low_memory_plus_lora():
    lean = load_config("frozenlake-starpo-s-ppo-24gb")
    assert (lean.lora.rank, lean.lora.alpha, lean.actor_rollout_ref.actor.optim.lr, lean.critic.optim.lr) == (
        64, 64, 1e-5, 1e-4)
    assert (lean.micro_batch_size_per_gpu, lean.ppo_mini_batch_size) == (1, 8)
    rollout = lean.actor_rollout_ref.rollout
    assert (rollout.max_model_len, rollout.response_length) == (2048, 128)
    assert kept_mini_batches(lean) == 4  # 8 × 16 × 0.25 = 32 trajectories in mini-batches of 8
    assert lean.es_manager.train.env_configs.tags == ("FrozenLake",)


@pytest.mark.parametrize("p,n", [(4, 32), (8, 16), (16, 8), (32, 4), (64, 2), (128, 1)])
def test_prompt_diversity_splits_keep_128_trajectories(p, n):
    config = load_config(f"sokoban-pxn-{p}x{n}")
    train = config.es_manager.train
    assert (train.env_groups, train.group_size, train.env_configs.n_groups) == (p, n, (p,))
    assert config.es_manager.val.env_configs.tags == GENERALIZATION_VAL
    assert config.es_manager.val.env_configs.n_groups == (128,) * 4 and config.es_manager.val.group_size == 1
    expected_ratio = 1.0 if n == 1 else 0.25
    assert config.actor_rollout_ref.rollout.rollout_filter_ratio == expected_ratio
    assert config.algorithm.adv_estimator == "gae" and config.actor_rollout_ref.actor.clip_ratio_high == 0.28


def test_actions_per_turn_and_online_k_studies():
    for k in range(1, 8):
        config = load_config(f"sokoban-actions{k}")
        assert config.agent_proxy.max_actions_per_turn == k and config.agent_proxy.max_turn == 5
        budgets = {tag: entry.max_actions_per_traj for tag, entry in config.custom_envs.items()}
        assert budgets == {**{tag: 5 * k for tag in GENERALIZATION_VAL}, "Bandit": 1, "BanditTest": 1, "Countdown": 1}
        assert config.es_manager.train.env_configs.tags == ("SimpleSokoban",)
    expected = {1: (8, 200), 2: (16, 100), 5: (40, 40), 10: (80, 80)}
    for k, (env_groups, steps) in expected.items():
        config = load_config(f"sokoban-online{k}")
        assert config.es_manager.train.env_groups == env_groups and config.es_manager.train.group_size == 16
        assert config.trainer.total_training_steps == steps
        assert kept_mini_batches(config) == k  # one rollout batch feeds k updates
    nothink = load_config("sokoban-generalization-nothink")
    assert nothink.agent_proxy.enable_think is False and nothink.es_manager.val.env_configs.tags == GENERALIZATION_VAL


@pytest.mark.parametrize("name,train,test", [
    ("bandit-generalization", ("Engineer", "Teacher"), ("Trader", "Librarian")),
    ("bandit-generalization-nothink", ("Engineer", "Teacher"), ("Trader", "Librarian")),
    ("bandit-generalization-rev", ("Teacher", "Engineer"), ("Librarian", "Trader")),
    ("bandit-generalization-rev-nothink", ("Teacher", "Engineer"), ("Librarian", "Trader")),
])
def test_bandit_generalization_runs_use_ragens_arm_names(name, train, test):
    """``train_all.sh`` §5.1: (low, high) arms of the training and the held-out tag; "rev" swaps both."""
    config = load_config(name)
    arms = {tag: (entry.env_config["lo_arm_name"], entry.env_config["hi_arm_name"])
            for tag, entry in config.custom_envs.items() if tag in ("Bandit", "BanditTest")}
    assert arms == {"Bandit": train, "BanditTest": test}
    assert config.es_manager.train.env_configs.tags == ("Bandit",)
    assert config.es_manager.val.env_configs.tags == ("Bandit", "BanditTest")
    assert config.agent_proxy.enable_think is not name.endswith("-nothink")
    assert config.algorithm.adv_estimator == "gae" and config.actor_rollout_ref.rollout.rollout_filter_ratio == 0.25


@pytest.mark.parametrize("name,devices", [("gpu", 1), ("gpu-8", 8), ("v4-8", 4), ("v5e-8", 8), ("v4-32", 16)])
def test_mesh_presets_fit_the_paper_mini_batch(name, devices):
    mesh = MESH_PRESETS[name]
    data, fsdp, tensor = mesh.shape(devices)
    config = load_config("sokoban-starpo-s-ppo")
    assert config.ppo_mini_batch_size % (config.micro_batch_size_per_gpu * data * fsdp) == 0
    assert 896 % tensor == 0 and 2 % tensor == 0  # Qwen2.5-0.5B hidden size and kv heads split evenly


def test_mesh_values_by_name_or_sizes():
    assert mesh_config("v4-32") == MeshConfig(1, 8, 2)
    assert mesh_config("2,-1,1") == MeshConfig(2, -1, 1)
    for bad in ("v9-8", "1,2", "a,b,c"):
        with pytest.raises(ValueError, match="--mesh must be (one of|three integers)"):
            mesh_config(bad)
