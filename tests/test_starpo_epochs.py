"""RAGEN's update keys take effect: ``ppo_epochs`` and ``shuffle``, learning-rate warmup and cosine schedules,
the critic's own mini- and micro-batch sizes, ``critic_warmup`` and ``lora.target_modules``."""

import math
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from runtime.mesh import MeshConfig, make_mesh
from runtime.sharding import create_sharded
from runtime.train_state import TrainState
from starpo_jax.config import OptimConfig
from starpo_jax.iteration import build_learner, num_micro_batches, run_epochs, update
from starpo_jax.models.transformer import CausalLM, Critic
from starpo_jax.presets import load_config
from starpo_jax.steps import learning_rate, make_optimizer
from starpo_jax.trainer import lora_config
from test_starpo_iteration import MODEL, OVERRIDES, trajectory


class Rows(NamedTuple):
    x: jax.Array
    y: jax.Array


def linear_step(tx):
    """A compiled least-squares step on ``Rows``; metrics hold the rows it saw."""
    @jax.jit
    def step(state: TrainState, frozen, batch: Rows):
        grads = jax.grad(lambda w: jnp.mean((batch.x @ w - batch.y) ** 2))(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        return TrainState(optax.apply_updates(state.params, updates), opt_state, state.step + 1, state.rng), \
            {"rows": batch.y}

    return step


def linear_problem():
    rng = np.random.default_rng(0)
    batch = Rows(jnp.asarray(rng.normal(size=(8, 3)), jnp.float32), jnp.arange(8, dtype=jnp.float32))
    tx = optax.adam(0.1)
    params = jnp.ones(3)
    return linear_step(tx), TrainState(params, tx.init(params), jnp.int32(0), jax.random.key(0)), batch


SHARDING = jax.sharding.SingleDeviceSharding(jax.devices()[0])


def test_two_epochs_equal_two_sequential_one_epoch_passes_without_shuffle():
    step, state, batch = linear_problem()
    two, metrics = run_epochs(step, state, None, batch, 2, 2, None, SHARDING)
    one, _ = run_epochs(step, state, None, batch, 2, 1, None, SHARDING)
    again, _ = run_epochs(step, one, None, batch, 2, 1, None, SHARDING)
    chex.assert_trees_all_close(two.params, again.params, rtol=0, atol=0)
    assert int(two.step) == 8 and len(metrics) == 8
    seen = np.concatenate([m["rows"] for m in metrics])
    np.testing.assert_array_equal(seen, np.tile(np.arange(8), 2))  # row order kept without shuffle


def test_shuffle_permutes_each_epoch_with_the_seed():
    step, state, batch = linear_problem()

    def order(key, epochs=2):
        _, metrics = run_epochs(step, state, None, batch, 4, epochs, key, SHARDING)
        return np.concatenate([m["rows"] for m in metrics]).reshape(epochs, 8).astype(int)

    first = order(jax.random.key(1))
    for epoch in first:
        assert sorted(epoch) == list(range(8))
    assert not np.array_equal(first[0], first[1])  # a fresh permutation each epoch
    np.testing.assert_array_equal(first, order(jax.random.key(1)))
    assert not np.array_equal(first, order(jax.random.key(2)))
    expected = np.asarray(jax.random.permutation(jax.random.fold_in(jax.random.key(1), 0), 8))
    np.testing.assert_array_equal(first[0], expected)


def test_warmup_schedules_match_hand_computed_values():
    lr = 1e-3
    constant = learning_rate(OptimConfig(lr=lr, lr_warmup_steps_ratio=0.25), total_steps=8, updates_per_step=3)
    # W = int(0.25 * 8) = 2 iterations of 3 updates each: f(s) = min(1, s / 2) at iteration s = count // 3.
    for count, factor in ((0, 0.0), (2, 0.0), (3, 0.5), (5, 0.5), (6, 1.0), (23, 1.0)):
        np.testing.assert_allclose(constant(jnp.int32(count)), lr * factor, rtol=1e-6, err_msg=str(count))
    cosine = learning_rate(OptimConfig(lr=lr, lr_warmup_steps=2, lr_warmup_steps_ratio=0.9, warmup_style="cosine",
                                       min_lr_ratio=0.1), total_steps=10)
    # W = 2 (lr_warmup_steps wins over the ratio); after it 0.55 + 0.45 cos(2π · 0.5 · (s − 2) / 8).
    for step, factor in ((1, 0.5), (2, 1.0), (6, 0.55), (10, 0.1)):
        np.testing.assert_allclose(cosine(jnp.int32(step)), lr * factor, rtol=1e-5, atol=1e-9, err_msg=str(step))
    np.testing.assert_allclose(cosine(jnp.int32(4)), lr * (0.55 + 0.45 * math.cos(math.pi * 2 / 8)), rtol=1e-5)
    assert learning_rate(OptimConfig(lr=lr)) == lr  # no warmup: the plain constant


def test_the_optimizer_follows_the_warmup():
    """Iteration 0 of a warmup has learning rate 0: AdamW (decay included) leaves the parameters as they are."""
    tx = make_optimizer(OptimConfig(lr=0.1, lr_warmup_steps=2), grad_clip=1.0, total_steps=4)
    params = {"w": jnp.ones(3)}
    opt_state = tx.init(params)
    trajectory_of_w = []
    for _ in range(3):
        updates, opt_state = tx.update({"w": jnp.ones(3)}, opt_state, params)
        params = optax.apply_updates(params, updates)
        trajectory_of_w.append(float(params["w"][0]))
    assert trajectory_of_w[0] == 1.0
    assert trajectory_of_w[2] < trajectory_of_w[1] < 1.0


@pytest.fixture(scope="module")
def warmup_run():
    """GAE with 2 actor epochs, shuffled, a critic of its own batch sizes and epochs, critic_warmup=2: two
    iterations."""
    config = load_config("starpo-s-ppo", OVERRIDES + (
        "micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.ppo_epochs=2", "actor_rollout_ref.actor.shuffle=True",
        "critic.ppo_mini_batch_size=2", "critic.ppo_micro_batch_size_per_gpu=1", "critic.ppo_epochs=2",
        "trainer.critic_warmup=2",
        "trainer.total_training_steps=4", "actor_rollout_ref.actor.optim.lr_warmup_steps=2"))
    mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    with jax.set_mesh(mesh):
        policy = create_sharded(lambda: CausalLM(MODEL, lora=None, rngs=nnx.Rngs(0)), mesh)
        critic = create_sharded(lambda: Critic(MODEL, lora=None, rngs=nnx.Rngs(1)), mesh)
        learner, actor, critic_state, _ = build_learner(config, policy, critic, mesh)
        before = jax.device_get(actor.params)
        runs = []
        for step in range(2):
            actor, critic_state, metrics = update(actor, critic_state, learner, trajectory(), config, step=step)
            runs.append((jax.device_get(actor.params), int(actor.step), int(critic_state.step), metrics))
    return config, mesh, before, runs


def test_critic_warmup_leaves_the_actor_unchanged_then_epochs_count(warmup_run):
    config, mesh, before, runs = warmup_run
    (params_0, actor_steps_0, critic_steps_0, metrics_0), (params_1, actor_steps_1, critic_steps_1, metrics_1) = runs
    chex.assert_trees_all_close(params_0, before, rtol=0, atol=0)  # iteration 1 < critic_warmup = 2
    assert actor_steps_0 == 0 and "actor/pg_loss" not in metrics_0 and "critic/vf_loss" in metrics_0
    # 2 of 4 groups kept × 4 rollouts = 8 rows: actor 2 epochs × 8 / 4, critic 2 epochs × 8 / 2 mini-batches.
    assert (actor_steps_1, critic_steps_0, critic_steps_1) == (4, 8, 16)
    # The actor's first iteration is warmup iteration 0 of 2 (its optimizer counts only its own updates): lr 0.
    assert metrics_1["actor/lr"] == 0.0 and metrics_1["critic/lr"] == pytest.approx(1e-3)
    chex.assert_trees_all_close(params_1, before, rtol=0, atol=0)
    assert num_micro_batches(config, mesh, "critic") == 2 and num_micro_batches(config, mesh) == 2


def test_lora_target_modules_restrict_the_adapters():
    config = load_config("starpo-s-ppo-lora", OVERRIDES + ("lora.rank=4", "lora.target_modules=q_proj,v_proj"))
    mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])

    def adapted(lora):
        with jax.set_mesh(mesh):
            model = create_sharded(lambda: CausalLM(MODEL, lora=lora, rngs=nnx.Rngs(0)), mesh)
        return {str(path[-2]) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}

    assert adapted(lora_config(config)) == {"q_proj", "v_proj"}
    assert len(adapted(lora_config(load_config("starpo-s-ppo-lora", OVERRIDES)))) == 7
