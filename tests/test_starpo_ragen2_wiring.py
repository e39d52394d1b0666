"""RAGEN-2 wired into the trainer: the SNR-aware filter decides what trains (or skips the step), advantages are
scaled and reweighted, GRPO / Dr. GRPO / GAE follow ``ragen_version``, and a tiny run logs the collapse and
filter metrics and stops early on empty batches (ragen2.md §3-§4, §6.2)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from launch import starpo
from runtime.mesh import MeshConfig, make_mesh
from runtime.metrics import read_jsonl
from runtime.sharding import create_sharded
from starpo_jax.advantages import (AdvantageInputs, AdvantageReturn, compute_advantage,
                                   compute_gae_advantage_return, scale_advantages)
from starpo_jax.iteration import build_learner, select_groups, update
from starpo_jax.models.transformer import CausalLM
from starpo_jax.presets import load_config
from test_launch_starpo import checkpoint  # noqa: F401  (the tiny local Hugging Face checkpoint fixture)
from test_starpo_iteration import GROUP_SIZE, GROUPS, MODEL, trajectory

BASE = ("es_manager.train.env_groups=4", "es_manager.train.group_size=4", "es_manager.train.env_configs.n_groups=[4]",
        "ppo_mini_batch_size=8", "micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.optim.lr=1e-3")
V2_FILTER = "actor_rollout_ref.rollout.rollout_filter_strategy="


def group_std(traj):
    rewards = (traj.scores + traj.penalty).reshape(GROUPS, GROUP_SIZE)
    return rewards.std(axis=1, ddof=1)


def test_snr_filter_keeps_the_top_group_and_copies_rows_up_to_the_divisor():
    traj = trajectory()
    config = load_config("starpo-s-grpo", BASE + (V2_FILTER + "top_k_abs", "actor_rollout_ref.rollout.rollout_filter_value=1",
                                                  "ragen_version=v2", "agent_proxy.reward_normalization.method=identity"))
    kept, normalized, metrics, reward_std = select_groups(traj, config, 1)
    best = int(np.argmax(group_std(traj)))
    # one group of 4 rows, copied up to lcm(env_groups 4, mini-batch 8) = 8 rows, all from the kept group
    np.testing.assert_array_equal(kept.group_ids, [best] * 8)
    assert metrics["rollout/filter_kept_count"] == 1 and metrics["rollout/filter_kept_ratio"] == 0.25
    np.testing.assert_allclose(reward_std, np.full(8, group_std(traj)[best]), rtol=1e-6)  # pre-filter, per row
    np.testing.assert_allclose(metrics["rollout/in_group_reward_std"], group_std(traj).mean(), rtol=1e-6)
    np.testing.assert_allclose(normalized[:GROUP_SIZE], (traj.scores + traj.penalty)[best * GROUP_SIZE:][:GROUP_SIZE])
    delete = load_config("starpo-s-grpo", BASE + (V2_FILTER + "top_k_abs", "actor_rollout_ref.rollout.rollout_filter_value=1",
                                                  "agent_proxy.batch_adjust_mode=delete"))
    assert len(select_groups(traj, delete, 1)[0].group_ids) == 0  # 4 rows mod 8: all deleted


@pytest.fixture(scope="module")
def grpo_learner():
    config = load_config("starpo-s-grpo", BASE + (V2_FILTER + "top_k_abs", "actor_rollout_ref.rollout.rollout_filter_value=2",
                                                  "ragen_version=v2"))
    mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    with jax.set_mesh(mesh):
        policy = create_sharded(lambda: CausalLM(MODEL, lora=None, rngs=nnx.Rngs(0)), mesh)
        learner, actor, _, _ = build_learner(config, policy, None, mesh)
    return config, mesh, learner, actor


def test_update_trains_on_the_filtered_rows_and_skips_an_empty_step(grpo_learner):
    config, mesh, learner, actor = grpo_learner
    traj = trajectory()
    top_two = np.sort(np.argsort(-group_std(traj), kind="stable")[:2])
    rows = np.concatenate([np.arange(g * GROUP_SIZE, (g + 1) * GROUP_SIZE) for g in top_two])
    with jax.set_mesh(mesh):
        trained, _, metrics = update(actor, None, learner, traj, config)
    assert metrics["train/batch_size"] == 8 and metrics["train/num_mini_batches"] == 1
    np.testing.assert_allclose(metrics["response_length/mean"], traj.loss_mask[rows].sum(axis=1).mean(), rtol=1e-6)
    assert int(trained.step) == 1
    before = jax.device_get(trained.params)
    # Linear top-p whose threshold p·Σs − ε is not positive keeps nothing (ragen2.md §4.4): no update at all.
    empty = load_config("starpo-s-grpo", BASE + (V2_FILTER + "top_p", "actor_rollout_ref.rollout.rollout_filter_value=0.5",
                                                 "actor_rollout_ref.rollout.rollout_filter_selection_eps=100",
                                                 "ragen_version=v2"))
    with jax.set_mesh(mesh):
        skipped, _, metrics = update(trained, None, learner, traj, empty)
    assert metrics["train/batch_size"] == 0 and metrics["rollout/filter_kept_count"] == 0
    assert int(skipped.step) == 1 and "actor/pg_loss" not in metrics
    chex.assert_trees_all_equal(jax.device_get(skipped.params), before)


def test_grpo_follows_ragen_version_and_dr_grpo_drops_the_std():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=8).astype(np.float32)
    group_ids = np.repeat([3, 7], 4)
    mask = (rng.random((8, 5)) < 0.7).astype(np.float32)
    rewards = np.zeros((8, 5), np.float32)
    rewards[:, -1] = scores
    inputs = AdvantageInputs(jnp.asarray(rewards), None, jnp.asarray(mask), jnp.asarray(group_ids), None, None)
    grouped = scores.reshape(2, 4)
    centred = (grouped - grouped.mean(1, keepdims=True)).reshape(-1)
    std = np.repeat(grouped.std(1, ddof=1), 4)
    for overrides, want in (((), scores), (("ragen_version=v2",), centred / (std + 1e-6)),
                            (("ragen_version=v2", "algorithm.norm_adv_by_std_in_grpo=False"), centred)):
        config = load_config("starpo-s-grpo", overrides)
        np.testing.assert_allclose(compute_advantage(inputs, config).advantages, want[:, None] * mask, rtol=1e-5,
                                   atol=1e-6)
    values = rng.normal(size=(8, 5)).astype(np.float32)
    gae_inputs = inputs._replace(values=jnp.asarray(values))
    v2 = compute_advantage(gae_inputs, load_config("starpo-s-ppo", ("ragen_version=v2",)))
    want = compute_gae_advantage_return(rewards, values, mask, 1.0, 1.0, skip_non_response=True)
    np.testing.assert_allclose(v2.advantages, want.advantages, rtol=1e-6)


def test_soft_reweighting_then_filter_loss_scaling_scale_only_the_advantages():
    rewards = np.zeros((6, 3), np.float32)
    rewards[:, -1] = [0, 1, 0, 2, 2, 2]
    group_ids = np.repeat([0, 1, 2], 2)
    adv = AdvantageReturn(jnp.ones((6, 3)), jnp.full((6, 3), 5.0))
    config = load_config("starpo-s-grpo", ("ragen_version=v2", "algorithm.soft_advantage_reweight=True",
                                           "actor_rollout_ref.actor.filter_loss_scaling=sqrt"))
    out, metrics = scale_advantages(adv, jnp.asarray(rewards), jnp.asarray(group_ids), config, kept_ratio=0.25)
    std = np.array([np.std([0, 1], ddof=1), np.std([0, 2], ddof=1), 0.0])
    weights = np.repeat(std / (std.max() + 1e-6), 2)
    np.testing.assert_allclose(out.advantages, np.sqrt(0.25) * weights[:, None] * np.ones((6, 3)), rtol=1e-6)
    np.testing.assert_array_equal(out.returns, adv.returns)
    assert metrics["train/soft_reweight_max"] == pytest.approx(weights.max())
    linear = load_config("starpo-s-grpo", ("actor_rollout_ref.actor.filter_loss_scaling=linear",))
    out, metrics = scale_advantages(adv, jnp.asarray(rewards), jnp.asarray(group_ids), linear, kept_ratio=0.25)
    np.testing.assert_allclose(out.advantages, 0.25)
    assert not metrics


def tiny_run(checkpoint, out, steps, *extra):  # noqa: F811
    return starpo.main([
        "--preset", "tiny", "--out", str(out), "--mesh", "1,-1,1", f"model_path={checkpoint}",
        "es_manager.train.env_configs.tags=[Bandit]", "es_manager.val.env_configs.tags=[BanditTest]",
        f"trainer.total_training_steps={steps}", "trainer.test_freq=0", "trainer.val_before_train=False",
        "actor_rollout_ref.rollout.response_length=8", "actor_rollout_ref.rollout.max_model_len=1024",
        "agent_proxy.max_turn=1", "ppo_mini_batch_size=8", "micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.rollout_filter_ratio=0.25", *extra])


def test_tiny_run_logs_collapse_and_filter_metrics_then_stops_on_empty_batches(checkpoint, tmp_path):  # noqa: F811
    tiny_run(checkpoint, tmp_path / "kept", 2, V2_FILTER + "top_k_abs", "actor_rollout_ref.rollout.rollout_filter_value=1",
             "collapse_detection.first_turn_enabled=True", "collapse_detection.multi_turn_enabled=True",
             "collapse_detection.compute_freq=2")
    rows = read_jsonl(tmp_path / "kept" / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:  # steps 1 and 2 are on RAGEN-2's cadence (1, then every compute_freq)
        assert row["collapse/first_turn_num_total"] == 16 and "collapse/valid_thinking_rate" in row
        assert row["timing_s/collapse_total"] > 0 and "timing_s/collapse_first_turn_step" in row
        # one group of 4 kept and copied to lcm(4 groups, mini-batch 8) = 8 rows, which train
        assert row["rollout/filter_kept_count"] == 1 and row["train/batch_size"] == 8 and "actor/pg_loss" in row
        assert row["rollout/empty_after_filter"] == 0
    tiny_run(checkpoint, tmp_path / "empty", 5, V2_FILTER + "top_p", "actor_rollout_ref.rollout.rollout_filter_value=0.5",
             "actor_rollout_ref.rollout.rollout_filter_selection_eps=100",
             "actor_rollout_ref.rollout.rollout_filter_empty_stop_steps=2")
    rows = read_jsonl(tmp_path / "empty" / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2] and "actor/pg_loss" not in rows[-1]
    assert rows[-1]["early_stopped/empty_filtered_steps"] == 1.0
    assert rows[-1]["rollout/consecutive_empty_after_filter_steps"] == 2


@pytest.mark.parametrize("overrides,message", [
    (("collapse_detection.micro_batch_size=16",), "collapse_detection.micro_batch_size=16 is not supported"),
    (("actor_rollout_ref.rollout.rollout_filter_value=0.9",), "rollout_filter_value does not apply to"),
    ((V2_FILTER + "top_p", "actor_rollout_ref.rollout.rollout_filter_ratio=0.5"), "rollout_filter_ratio does not apply"),
    ((V2_FILTER + "top_q",), "rollout_filter_strategy must be one of"),
    (("trainer.gradient_analysis_only=True",), "trainer.gradient_analysis_only act"),
    (("trainer.gradient_analysis_mode=True", "trainer.gradient_analysis_log_prefilter=True"),
     "gradient_analysis_log_prefilter analyses the separate analysis batch"),
    (("trainer.gradient_analysis_mode=True", "trainer.gradient_analysis_env_groups=2",
      "es_manager.train.env_configs.tags=[SimpleSokoban,FrozenLake]", "es_manager.train.env_configs.n_groups=[3,1]"),
     "leaves a tag of es_manager.train.env_configs without groups .its n_groups rescale to [2, 0]"),
    (("trainer.gradient_analysis_mode=True", "trainer.gradient_analysis_group_size=1"),
     "the gradient analysis batch .*group_size must be >= 2"),
    ((V2_FILTER + "top_p", "actor_rollout_ref.rollout.rollout_filter_type=middle"), "rollout_filter_type must be"),
    ((V2_FILTER + "top_p", "actor_rollout_ref.rollout.rollout_filter_metric=length",
      "trainer.early_stop_reward_variance_collapse=True"), "early_stop_reward_variance_collapse"),
    ((V2_FILTER + "top_p", "actor_rollout_ref.actor.optim.lr_warmup_steps=3"), "constant learning rate"),
    (("agent_proxy.batch_adjust_mode=delete",), "batch_adjust_mode='delete' applies to RAGEN-2"),
    (("algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=False"), "set ragen_version=v2"),
    (("algorithm.soft_advantage_reweight=True",), "soft_advantage_reweight needs"),
    (("collapse_detection.first_turn_enabled=True", "agent_proxy.enable_think=False"), "enable_think=True"),
])
def test_ragen2_keys_that_would_not_take_effect_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        load_config("starpo-s-ppo", BASE + ("ppo_mini_batch_size=4",) + overrides)
