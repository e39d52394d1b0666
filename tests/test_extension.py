"""Extending without editing the library: a new advantage estimator (RLOO), rollout filter, policy loss and JAX
environment type, registered here, drive one full StarPO iteration (fused rollout, then the update).

Each part is checked to have taken effect: the coin environment's trajectories, the filter's kept groups, the RLOO
advantages and the REINFORCE loss against NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, struct
from gymnax.environments import spaces

import envs
from envs.base import TextEnvironment, step_info
from envs.registry import ENV_TYPES
from runtime.mesh import MeshConfig, make_mesh
from runtime.sharding import shard_state
from starpo_jax.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, AdvantageReturn, advantage_estimator
from starpo_jax.chat_tokenizer import train_chat_tokenizer
from starpo_jax.env_manager import GymnaxHostEnv, reset_slot
from starpo_jax.filtering import FILTER_TYPES
from starpo_jax.fused_rollout import build_env_tables, fused_rollout, make_fused_rollout
from starpo_jax.iteration import build_learner, update
from starpo_jax.losses import POLICY_LOSSES, LossOutput, aggregate_loss
from starpo_jax.models.config import TransformerConfig
from starpo_jax.models.transformer import CausalLM
from starpo_jax.presets import load_config
from starpo_jax.rollout import RolloutSettings
from starpo_jax.sampler import SamplerConfig
from starpo_jax.trajectory import render_chat
from test_starpo_fused_rollout import chain_params

RESPONSE = "go</think><answer>Heads</answer>"
GROUPS, GROUP_SIZE = 4, 4


@struct.dataclass
class CoinState:
    time: jax.Array


class CoinToss(TextEnvironment):
    """Guess a fair coin: one action, reward 1 when the toss (drawn at the step) matches it."""

    action_names = ("Heads", "Tails")
    env_instruction = "Guess how the coin lands."
    max_actions_per_traj = 1
    max_tokens = 20

    @property
    def default_params(self):
        return None

    def reset_env(self, key, params):
        state = CoinState(jnp.int32(0))
        return self.get_obs(state), state

    def step_env(self, key, state, action, params):
        heads = jax.random.bernoulli(key)
        reward = (heads == (action == 0)).astype(jnp.float32)
        state = CoinState(state.time + 1)
        return self.get_obs(state), state, reward, jnp.bool_(True), step_info(reward > 0, True, True)

    def get_obs(self, state, params=None, key=None):
        return state.time[None]

    def is_terminated(self, state, params):
        return state.time > 0

    def observation_space(self, params=None):
        return spaces.Box(0, 1, (1,), jnp.int32)

    def render_text(self, state, params=None) -> str:
        return "A coin is in the air."

    def step_reward_values(self, params) -> tuple[float, ...]:
        return (0.0, 1.0)

    def reward_value(self, reward: float, params=None) -> float:
        return float(round(reward))


def rloo(inputs: AdvantageInputs, config) -> AdvantageReturn:
    """REINFORCE leave-one-out: each score minus the mean of the other scores of its group."""
    scores = jnp.sum(inputs.token_level_rewards, axis=-1)
    groups = config.es_manager.train.env_groups
    sums = jax.ops.segment_sum(scores, inputs.group_ids, groups)
    counts = jax.ops.segment_sum(jnp.ones_like(scores), inputs.group_ids, groups)
    baseline = (sums[inputs.group_ids] - scores) / jnp.maximum(counts[inputs.group_ids] - 1, 1)
    advantages = (scores - baseline)[:, None] * inputs.loss_mask
    CALLS.append((inputs, advantages))
    return AdvantageReturn(advantages, advantages)


def top_mean_groups(scores, in_group_std, kept):
    """The groups with the highest mean score."""
    return jnp.argsort(-jnp.mean(scores, axis=1), stable=True)[:kept]


def reinforce_loss(log_probs, old_log_probs, advantages, loss_mask, clip_ratio_low, clip_ratio_high, clip_ratio_c,
                   loss_agg_mode, normalizer=None) -> LossOutput:
    """Plain REINFORCE, ``−A · log π``, with no ratio or clipping."""
    loss = aggregate_loss(-advantages * log_probs, loss_mask, loss_agg_mode, normalizer)
    return LossOutput(loss, {"actor/pg_loss": loss})


CALLS: list = []


@pytest.fixture(scope="module")
def registered():
    advantage_estimator("rloo")(rloo)
    FILTER_TYPES.register("top_mean", top_mean_groups)
    POLICY_LOSSES.register("reinforce", reinforce_loss)
    ENV_TYPES.register("coin", CoinToss)
    yield
    for registry, name in ((ADVANTAGE_ESTIMATORS, "rloo"), (FILTER_TYPES, "top_mean"),
                           (POLICY_LOSSES, "reinforce"), (ENV_TYPES, "coin")):
        registry.unregister(name)


@pytest.fixture(scope="module")
def iteration(registered, tmp_path_factory):
    config = load_config("tiny", (
        "custom_envs.Coin.env_type=coin", "es_manager.train.env_configs.tags=[Coin]",
        "es_manager.val.env_configs.tags=[Coin]", "algorithm.adv_estimator=rloo",
        "actor_rollout_ref.rollout.rollout_filter_type=top_mean", "actor_rollout_ref.actor.policy_loss.loss_mode=reinforce",
        "agent_proxy.rollout_driver=fused", "train_on_sampled_ids=True", "agent_proxy.max_turn=1",
        "agent_proxy.max_actions_per_turn=1", "ppo_mini_batch_size=8", "micro_batch_size_per_gpu=8"))
    env = envs.make("Coin", config.custom_envs)
    slot = reset_slot(GymnaxHostEnv(env), 0, 0, 0)
    corpus = [render_chat(slot.prefix, slot.history)[1]["content"]] * 5 + [f"<think>{RESPONSE}"] * 20
    tokenizer = train_chat_tokenizer(corpus, tmp_path_factory.mktemp("tok"), vocab_size=512)
    model = TransformerConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=8)
    with nnx.use_eager_sharding(False):
        graphdef, params = nnx.split(CausalLM(model, rngs=nnx.Rngs(0)))
    chain = [tokenizer.convert_tokens_to_ids("<think>")] + tokenizer.encode(RESPONSE) + [tokenizer.eos_token_id]
    params = chain_params(params, chain, model)
    settings = RolloutSettings(max_turn=1, max_actions_per_turn=1, max_model_len=512, train_on_sampled_ids=True,
                               bucket=64)
    sampler = SamplerConfig(max_new_tokens=len(chain), greedy=True, stop_ids=(tokenizer.eos_token_id,),
                            pad_id=tokenizer.pad_token_id)
    mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    program = make_fused_rollout(graphdef, model, sampler, [build_env_tables(env, tokenizer, settings)],
                                 [GROUPS * GROUP_SIZE], tokenizer, settings, mesh)
    group_ids = np.repeat(np.arange(GROUPS), GROUP_SIZE)
    CALLS.clear()
    with jax.set_mesh(mesh):
        # One seed per row (every reset state is the same): the tosses, hence the scores, vary within a group.
        out = fused_rollout(program, shard_state(params, mesh), tokenizer, 100 + np.arange(len(group_ids)),
                            group_ids, jax.random.key(3))
        learner, actor, _, _ = build_learner(config, nnx.merge(graphdef, params), None, mesh)
        _, _, metrics = update(actor, None, learner, out.trajectory, config)
    return dict(config=config, traj=out.trajectory, rollout_metrics=out.metrics, metrics=metrics)


def test_the_coin_environment_ran_on_device(iteration):
    traj = iteration["traj"]
    assert set(np.unique(traj.scores)) == {0.0, 1.0}
    assert np.all(traj.penalty == 0) and all(m["action_is_valid"] == 1 for m in iteration["rollout_metrics"])
    assert not iteration["config"].use_critic


def test_the_filter_kept_the_groups_with_the_highest_mean(iteration):
    inputs, _ = CALLS[-1]
    raw = (iteration["traj"].scores + iteration["traj"].penalty).reshape(GROUPS, GROUP_SIZE)
    kept = np.sort(np.argsort(-raw.mean(axis=1), kind="stable")[:GROUPS // 2])
    np.testing.assert_array_equal(np.asarray(inputs.group_ids), np.repeat(kept, GROUP_SIZE))


def test_rloo_advantages_match_numpy(iteration):
    inputs, advantages = CALLS[-1]
    scores = np.asarray(inputs.token_level_rewards).sum(-1).reshape(-1, GROUP_SIZE)
    expected = scores - (scores.sum(1, keepdims=True) - scores) / (GROUP_SIZE - 1)
    assert np.abs(expected).max() > 0, "the kept groups' scores vary, so RLOO is not trivially zero"
    np.testing.assert_allclose(advantages, expected.reshape(-1, 1) * np.asarray(inputs.loss_mask), atol=1e-6)
    np.testing.assert_allclose(iteration["metrics"]["critic/advantages/mean"],
                               (advantages * inputs.loss_mask).sum() / inputs.loss_mask.sum(), rtol=1e-5, atol=1e-6)


def test_reinforce_loss_matches_numpy(iteration):
    inputs, advantages = CALLS[-1]
    mask, log_probs = np.asarray(inputs.loss_mask), np.asarray(inputs.old_log_probs)
    per_sequence = (-np.asarray(advantages) * log_probs * mask).sum(1) / np.maximum(mask.sum(1), 1)
    expected = per_sequence[mask.sum(1) > 0].mean()  # seq-mean-token-mean
    np.testing.assert_allclose(iteration["metrics"]["actor/pg_loss"], expected, rtol=1e-4, atol=1e-5)
    assert "actor/pg_clipfrac" not in iteration["metrics"]
