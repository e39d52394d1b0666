"""A full StarPO update (filter, log-probs, values, advantages, critic and actor steps) on 8 devices equals 1
for each algorithm preset; the LoRA preset trains only adapters; turn scores replace the final reward."""

import chex
import jax
import numpy as np
import optax
import pytest
from flax import nnx

from runtime.mesh import MeshConfig, make_mesh
from runtime.sharding import create_sharded
from starpo_jax.iteration import build_learner, num_micro_batches, select_groups, update
from starpo_jax.models.config import TransformerConfig
from starpo_jax.models.lora import LoRAConfig
from starpo_jax.models.transformer import CausalLM, Critic
from starpo_jax.presets import load_config
from starpo_jax.trajectory import Trajectory, position_ids

MODEL = TransformerConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=8, attention_bias=True)
GROUPS, GROUP_SIZE, L = 4, 4, 16
OVERRIDES = ("es_manager.train.env_groups=4", "es_manager.train.group_size=4", "es_manager.train.env_configs.n_groups=[4]",
             "ppo_mini_batch_size=4", "actor_rollout_ref.rollout.rollout_filter_ratio=0.5",
             "actor_rollout_ref.actor.optim.lr=1e-3", "critic.optim.lr=1e-3")


def trajectory():
    rng = np.random.default_rng(0)
    b = GROUPS * GROUP_SIZE
    lengths = rng.integers(8, L + 1, size=b)
    mask = (np.arange(L)[None, :] >= L - lengths[:, None]).astype(np.int32)
    ids = np.where(mask, rng.integers(1, MODEL.vocab_size, size=(b, L)), 0).astype(np.int32)
    loss_mask = (mask[:, 1:] * (rng.random((b, L - 1)) < 0.6)).astype(np.float32)
    scores = (rng.random(b) < np.repeat([0.1, 0.5, 0.9, 0.5], GROUP_SIZE)).astype(np.float32)
    return Trajectory(ids, mask, position_ids(mask), loss_mask, scores, np.full(b, -0.1, np.float32) * (scores == 0),
                      np.repeat(np.arange(GROUPS), GROUP_SIZE).astype(np.int32), np.zeros(b, np.int32))


def run(preset, mesh, micro_batch_size_per_gpu, overrides=(), traj=None):
    config = load_config(preset, OVERRIDES + (f"micro_batch_size_per_gpu={micro_batch_size_per_gpu}",) + overrides)
    lora = LoRAConfig(rank=config.lora.rank, alpha=float(config.lora.alpha)) if config.lora.rank else None
    with jax.set_mesh(mesh):
        policy = create_sharded(lambda: CausalLM(MODEL, lora=lora, rngs=nnx.Rngs(0)), mesh)
        critic = create_sharded(lambda: Critic(MODEL, lora=lora, rngs=nnx.Rngs(1)), mesh) if config.use_critic else None
        learner, actor, critic_state, _ = build_learner(config, policy, critic, mesh)
        actor, critic_state, metrics = update(actor, critic_state, learner, traj or trajectory(), config)
    return jax.device_get(actor.params), metrics, jax.device_get(optax.tree_utils.tree_get(actor.opt_state, "mu"))


@pytest.mark.parametrize("preset,present,absent", [
    ("starpo-s-ppo", ("critic/vf_loss",), ("actor/kl_loss", "actor/reward_kl_penalty", "rollout/ref_log_prob")),
    ("starpo-s-grpo", (), ("critic/vf_loss", "rollout/ref_log_prob")),
    ("starpo-ppo", ("critic/vf_loss", "actor/reward_kl_penalty", "rollout/ref_log_prob"), ("actor/kl_loss",)),
    ("starpo-grpo", ("actor/kl_loss", "rollout/ref_log_prob"), ("critic/vf_loss",)),
])
def test_update_on_eight_devices_equals_one(preset, present, absent):
    """Each algorithm preset (PPO with KL-in-reward, GRPO with KL loss, StarPO-S PPO and GRPO). Same
    micro-batches on both meshes (4 rows): averaged metrics such as clip fractions, like the reference's,
    depend on how a mini-batch is split; the update itself does not.

    The gradients are compared through Adam's first moment (0.1 × the clipped gradient). Parameters get a
    looser bound: Adam's first step is about lr·sign(g), so a gradient within rounding of 0 may flip sign
    between summation orders and move its parameter by up to 2·lr either way."""
    params_one, metrics_one, mu_one = run(preset, make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1]), 4)
    params_eight, metrics_eight, mu_eight = run(preset, make_mesh(MeshConfig(2, 2, 2)), 1)
    for (path, one), eight in zip(jax.tree_util.tree_flatten_with_path(mu_one)[0], jax.tree.leaves(mu_eight)):
        np.testing.assert_allclose(eight, one, rtol=1e-4, atol=1e-4 * np.abs(one).max(),
                                   err_msg=jax.tree_util.keystr(path))
    chex.assert_trees_all_close(params_eight, params_one, atol=2e-3)
    assert metrics_one["actor/grad_norm"] > 0
    for name, value in metrics_one.items():
        if not name.startswith("timing_s/"):
            np.testing.assert_allclose(metrics_eight[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    assert all(name in metrics_one for name in present) and not any(name in metrics_one for name in absent)
    assert metrics_one["rollout/chosen_in_group_std"] >= metrics_one["rollout/in_group_std"]


def test_micro_batch_size_must_divide_over_devices():
    config = load_config("starpo-s-ppo", OVERRIDES + ("micro_batch_size_per_gpu=2",))
    with pytest.raises(ValueError, match="ppo_mini_batch_size=4 must be a multiple of micro_batch_size_per_gpu=2 x 4"):
        num_micro_batches(config, make_mesh(MeshConfig(2, 2, 2)))


def test_lora_preset_trains_only_the_adapters():
    """``starpo-s-ppo-24gb``: LoRA with micro-batches of 1, on one device."""
    params, metrics, _ = run("starpo-s-ppo-24gb", make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1]), 1, ("lora.rank=4",))
    for name, value in metrics.items():
        assert np.isfinite(value), name
    assert metrics["actor/grad_norm"] > 0 and "critic/vf_loss" in metrics
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    assert paths and all("lora" in path for path in paths)


def test_turn_scores_replace_the_normalised_final_reward():
    """``use_turn_scores``: the per-turn rewards are the token rewards, not normalised (HEAD, starpo.md §7)."""
    traj = trajectory()
    rng = np.random.default_rng(1)
    turn_rewards = (rng.random(traj.loss_mask.shape) < 0.1) * rng.normal(size=traj.loss_mask.shape)
    sampler_log_probs = np.where(rng.random(traj.loss_mask.shape) < 0.5, -1.0, np.nan).astype(np.float32)
    traj = traj._replace(turn_rewards=turn_rewards.astype(np.float32), rollout_log_probs=sampler_log_probs)
    single = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    keep_all = ("actor_rollout_ref.rollout.rollout_filter_ratio=1",
                "agent_proxy.reward_normalization.method=mean_std")
    _, metrics, _ = run("starpo-s-ppo", single, 4, keep_all + ("agent_proxy.use_turn_scores=True",), traj)
    np.testing.assert_allclose(metrics["critic/score/mean"], turn_rewards.sum(axis=1).mean(), rtol=1e-5)
    trained = traj.loss_mask > 0
    np.testing.assert_allclose(metrics["rollout/sampled_token_fraction"],
                               (np.isfinite(sampler_log_probs) & trained).sum() / trained.sum(), rtol=1e-6)
    assert metrics["rollout/sampler_log_prob_diff_max"] > 0  # a random model's log-probs are not all -1
    _, normalised, _ = run("starpo-s-ppo", single, 4, keep_all, traj)
    np.testing.assert_allclose(normalised["critic/score/mean"], 0.0, atol=1e-5)  # mean_std centres each group


def test_turn_scores_filter_ranks_the_summed_turn_rewards():
    """With ``use_turn_scores`` the filter ranks ``turn_rewards.sum(-1)`` (HEAD ``original_rm_scores``)."""
    traj = trajectory()
    b = GROUPS * GROUP_SIZE
    turn_rewards = np.zeros(traj.loss_mask.shape, np.float32)
    # group 3 varies most in turn rewards although its scores do not vary at all
    turn_rewards[3 * GROUP_SIZE:, -1] = [0.0, 5.0, -5.0, 1.0]
    traj = traj._replace(scores=np.zeros(b, np.float32), penalty=np.zeros(b, np.float32), turn_rewards=turn_rewards)
    overrides = OVERRIDES + ("micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.rollout_filter_ratio=0.25")
    kept, _, metrics, _ = select_groups(traj, load_config("starpo-s-ppo", overrides + ("agent_proxy.use_turn_scores=True",)), 1)
    np.testing.assert_array_equal(kept.group_ids, [3] * GROUP_SIZE)
    want_std = np.std(turn_rewards.reshape(GROUPS, GROUP_SIZE, -1).sum(-1), axis=1, ddof=1)
    np.testing.assert_allclose(metrics["rollout/in_group_std"], want_std.mean(), rtol=1e-5)
    kept, _, _, _ = select_groups(traj, load_config("starpo-s-ppo", overrides), 1)
    np.testing.assert_array_equal(kept.group_ids, [0] * GROUP_SIZE)  # all scores tie: lowest group id
