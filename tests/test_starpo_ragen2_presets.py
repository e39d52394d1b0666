"""RAGEN-2's defaults switch and its runs as presets: main-table rows, intervention sweeps, slipper sweep (ragen2.md
§6.9, §7.2, §9.1-§9.2)."""

import dataclasses
import functools

from starpo_jax import presets
from starpo_jax.config import StarPOConfig
from starpo_jax.ragen2_presets import MAIN_TABLE_PRESETS, SLIPPER_PRESETS, SWEEP_PRESETS

load_config = functools.cache(presets.load_config)


def changed(a, b, prefix=""):
    """Dotted keys whose values differ between two config trees."""
    keys = []
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if dataclasses.is_dataclass(x):
            keys += changed(x, y, f"{prefix}{field.name}.")
        elif x != y:
            keys.append(prefix + field.name)
    return keys


def test_v2_switch_sets_ragen2_base_defaults():
    v1, v2 = load_config("starpo-s-ppo"), load_config("v2")
    rollout = v2.actor_rollout_ref.rollout
    assert v1.ragen_version == "v1" and v2.ragen_version == "v2"
    assert (rollout.rollout_filter_strategy, rollout.rollout_filter_value, rollout.rollout_filter_type,
            rollout.rollout_filter_include_zero, rollout.rollout_filter_top_p_prob_mode) == ("top_p", 1.0, "largest",
                                                                                            True, "linear")
    assert v2.collapse_detection.first_turn_enabled and v2.collapse_detection.multi_turn_enabled
    assert not v1.collapse_detection.enabled and v2.collapse_detection.compute_freq == 5
    assert v2.actor_rollout_ref.actor.loss_agg_mode == "seq-mean-token-mean"  # V2's token-mean at micro-batch 1
    assert v2.agent_proxy.max_actions_per_turn == 2 and v2.es_manager.train.env_configs.tags == ("CoordSokoban",)
    assert v2.trainer.early_stop_reward_variance_collapse and v2.trainer.early_stop_low_validation_success
    assert (v2.es_manager.val.env_groups, v2.es_manager.val.group_size) == (512, 1)
    assert StarPOConfig().actor_rollout_ref.rollout.rollout_filter_strategy == "starpo_s"


def test_main_table_rows_follow_the_run_script():
    assert len(MAIN_TABLE_PRESETS) == 4 * 4 * 2
    ppo, dapo = load_config("v2-sokoban-ppo-filter"), load_config("v2-sokoban-dapo-filter")
    # RAGEN-2's DAPO overrides restate the defaults (ragen2.md §9.1, derived): only an unused KL coefficient differs
    assert changed(ppo, dapo) == ["actor_rollout_ref.actor.kl_loss_coef"] and not dapo.actor_rollout_ref.actor.use_kl_loss
    assert not ppo.actor_rollout_ref.actor.use_kl_loss and not ppo.needs_ref_log_prob and not dapo.needs_ref_log_prob
    grpo, dr = load_config("v2-frozenlake-grpo-nofilter"), load_config("v2-frozenlake-drgrpo-nofilter")
    assert changed(grpo, dr) == ["actor_rollout_ref.actor.loss_agg_mode", "algorithm.norm_adv_by_std_in_grpo"]
    assert (dr.algorithm.adv_estimator, dr.actor_rollout_ref.actor.loss_agg_mode) == ("grpo", "seq-mean-token-sum")
    assert changed(ppo, load_config("v2-sokoban-ppo-nofilter")) == ["actor_rollout_ref.rollout.rollout_filter_value"]
    rollout = ppo.actor_rollout_ref.rollout
    assert (rollout.rollout_filter_value, rollout.rollout_filter_top_p_prob_mode, rollout.rollout_filter_include_zero) \
        == (0.9, "softmax", True)
    assert (ppo.model_path, ppo.trainer.total_training_steps, ppo.actor_rollout_ref.actor.loss_agg_mode) == (
        "Qwen/Qwen2.5-3B", 400, "token-mean")
    assert grpo.custom_envs["CoordFrozenLake"].env_config["success_rate"] == 1.0


def test_intervention_and_slipper_sweeps():
    assert len(SWEEP_PRESETS) == 8 + 12 + 6 and len(SLIPPER_PRESETS) == 14
    top_p = load_config("v2-sokoban-topp0.6")
    assert top_p.actor_rollout_ref.rollout.rollout_filter_value == 0.6
    assert not top_p.actor_rollout_ref.rollout.rollout_filter_include_zero and top_p.actor_rollout_ref.actor.use_kl_loss
    kl0, kl = load_config("v2-sokoban-kl0"), load_config("v2-sokoban-kl0.03-nozero")
    assert not kl0.actor_rollout_ref.actor.use_kl_loss and kl.actor_rollout_ref.actor.kl_loss_coef == 0.03
    assert kl.actor_rollout_ref.actor.entropy_coeff == 0 and not kl.actor_rollout_ref.rollout.rollout_filter_include_zero
    assert load_config("v2-sokoban-entropy0.1").actor_rollout_ref.actor.entropy_coeff == 0.1
    filtered, unfiltered = load_config("v2-frozenlake-slipper20-filter"), load_config("v2-frozenlake-slipper20-nofilter")
    assert sorted(changed(filtered, unfiltered)) == ["actor_rollout_ref.rollout.rollout_filter_include_zero",
                                                     "actor_rollout_ref.rollout.rollout_filter_value"]
    assert filtered.actor_rollout_ref.rollout.rollout_filter_top_p_prob_mode == "softmax"
    assert filtered.custom_envs["CoordFrozenLake"].env_config["success_rate"] == 0.8


def test_ragen2_presets_use_ragen2s_prompt_layout():
    for name in ("v2", "v2-frozenlake-slipper10-filter", "v2-2048-starpo-grpo"):
        config = presets.load_config(name)
        assert config.agent_proxy.prompt_layout == "v2" and config.agent_proxy.context_window_mode == "full", name
    assert presets.load_config("starpo-s-grpo").agent_proxy.prompt_layout == "v1"
