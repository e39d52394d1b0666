"""Actor and critic steps: sharded equals single-device, micro-batching, skip on NaN, LoRA-only updates."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from runtime.mesh import MeshConfig, batch_sharding, make_mesh
from runtime.sharding import create_sharded, shard_batch, shardings_of
from runtime.train_state import compile_step, init_train_state
from starpo_jax.config import ActorConfig, CriticConfig, OptimConfig
from starpo_jax.models.config import TransformerConfig
from starpo_jax.models.lora import LoRAConfig
from starpo_jax.models.transformer import CausalLM, Critic
from starpo_jax.steps import (CriticBatch, PolicyBatch, make_actor_step, make_critic_step, make_log_prob_fn,
                              make_optimizer, make_value_fn, micro_batches, model_token_log_probs, split_trainable,
                              token_log_probs)

CONFIG = TransformerConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=8, model_type="qwen2", attention_bias=True)
B, L = 8, 12
ACTOR = ActorConfig(optim=OptimConfig(lr=1e-2))


def test_token_log_probs_match_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
    ids = rng.integers(0, 7, size=(2, 5))
    lp, ent = token_log_probs(jnp.asarray(logits), jnp.asarray(ids), temperature=0.5)
    z = logits[:, :-1] / 0.5
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    want = np.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(lp, want, atol=1e-5)
    np.testing.assert_allclose(ent, -(np.exp(logp) * logp).sum(-1), atol=1e-5)


def test_chunked_log_probs_and_gradients_equal_full_logits():
    mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    with jax.set_mesh(mesh):
        model = create_sharded(lambda: CausalLM(CONFIG, rngs=nnx.Rngs(3)), mesh)
    ids = jax.random.randint(jax.random.key(1), (2, L), 0, CONFIG.vocab_size)
    mask = jnp.ones((2, L), jnp.int32).at[0, :3].set(0)

    def loss(model, chunk):  # chunk 5 splits the 11 scored positions into 3 chunks, the last one padded
        lp, ent = model_token_log_probs(model, ids, mask, 0.7, chunk)
        return jnp.sum(lp) + 0.1 * jnp.sum(ent), (lp, ent)

    (_, full), full_grads = nnx.value_and_grad(loss, has_aux=True)(model, L)
    (_, chunked), chunked_grads = nnx.value_and_grad(loss, has_aux=True)(model, 5)
    want = token_log_probs(model(ids, mask)[0], ids, 0.7)
    chex.assert_trees_all_close(full, want, atol=1e-6)
    chex.assert_trees_all_close(chunked, want, atol=1e-5)
    chex.assert_trees_all_close(nnx.state(chunked_grads), nnx.state(full_grads), atol=1e-5)


def test_micro_batches_take_strided_rows():
    x = jnp.arange(12).reshape(6, 2)
    parts = micro_batches(x, 3)
    np.testing.assert_array_equal(parts[1], [[2, 3], [8, 9]])
    with pytest.raises(ValueError, match="does not split into 4 micro-batches"):
        micro_batches(x, 4)


def policy_batch(seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(6, L + 1, size=B)
    mask = (np.arange(L)[None, :] >= L - lengths[:, None]).astype(np.int32)
    ids = np.where(mask, rng.integers(1, CONFIG.vocab_size, size=(B, L)), 0).astype(np.int32)
    loss_mask = (mask[:, 1:] * (rng.random((B, L - 1)) < 0.7)).astype(np.float32)
    return PolicyBatch(ids, mask, loss_mask, rng.normal(-3.0, 0.3, (B, L - 1)).astype(np.float32),
                       rng.normal(size=(B, L - 1)).astype(np.float32), np.zeros((B, L - 1), np.float32))


def run_actor(mesh, batch, num_micro=2, lora=None, steps=2):
    with jax.set_mesh(mesh):
        model = create_sharded(lambda: CausalLM(CONFIG, lora=lora, rngs=nnx.Rngs(0)), mesh)
        graphdef, trainable, frozen = split_trainable(model, lora is not None)
        tx = make_optimizer(ACTOR.optim, ACTOR.grad_clip)
        state = init_train_state(trainable, tx, jax.random.key(0), mesh)
        initial = jax.device_get(trainable)
        step = compile_step(make_actor_step(graphdef, tx, ACTOR, num_micro), state, shardings_of(frozen),
                            batch_sharding(mesh, 2))
        metrics = []
        for _ in range(steps):
            state, m = step(state, frozen, shard_batch(batch, mesh))
            metrics.append(jax.device_get(m))
        return initial, jax.device_get(state.params), metrics, (graphdef, state, frozen)


@pytest.fixture(scope="module")
def single():
    return run_actor(make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1]), policy_batch())


def test_actor_step_sharded_equals_single_device(single):
    _, params, metrics, _ = run_actor(make_mesh(MeshConfig(2, 2, 2)), policy_batch())
    # Adam divides by sqrt(v): where a gradient entry is near zero, reduction-order noise moves the update by
    # up to ~lr / 50; a sharding error moves whole tensors by ~lr = 1e-2.
    chex.assert_trees_all_close(params, single[1], atol=1e-3)
    for got, want in zip(metrics, single[2]):
        chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)
    assert metrics[0]["actor/grad_norm"] > 0 and metrics[0]["actor/non_finite_steps"] == 0
    assert not np.allclose(jax.tree.leaves(single[0])[0], jax.tree.leaves(single[1])[0])


def test_update_does_not_depend_on_micro_batching():
    batch = policy_batch()
    batch = batch._replace(loss_mask=np.where(np.arange(B)[:, None] == 5, 0.0, batch.loss_mask).astype(np.float32))
    mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    _, params_one, metrics_one, _ = run_actor(mesh, batch, num_micro=1, steps=1)
    _, params_four, metrics_four, _ = run_actor(mesh, batch, num_micro=4, steps=1)
    chex.assert_trees_all_close(params_four, params_one, atol=1e-4)
    for name in ("actor/grad_norm", "actor/pg_loss", "actor/entropy_loss"):
        np.testing.assert_allclose(metrics_four[0][name], metrics_one[0][name], rtol=1e-5, err_msg=name)


def test_non_finite_advantages_skip_the_update():
    batch = policy_batch()
    batch = batch._replace(advantages=np.where(np.arange(L - 1) == 3, np.nan, batch.advantages).astype(np.float32))
    initial, params, metrics, _ = run_actor(make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1]), batch)
    chex.assert_trees_all_equal(params, initial)
    assert [m["actor/non_finite_steps"] for m in metrics] == [1, 2]
    assert metrics[1]["actor/consecutive_non_finite"] == 2


def test_lora_updates_only_adapters_and_zeroed_adapters_give_the_base_model():
    mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    batch = policy_batch()
    initial, params, _, (graphdef, state, frozen) = run_actor(mesh, batch, lora=LoRAConfig(rank=4, alpha=8.0))
    assert {type(v) for v in jax.tree.leaves(state.params, is_leaf=lambda v: isinstance(v, nnx.Variable))} \
        == {nnx.LoRAParam}
    log_probs = jax.jit(make_log_prob_fn(graphdef, num_micro_batches=2))
    with jax.set_mesh(mesh):
        trained = log_probs(state.params, frozen, batch.input_ids, batch.attention_mask)
        zeroed = log_probs(jax.tree.map(jnp.zeros_like, state.params), frozen, batch.input_ids, batch.attention_mask)
        base = log_probs(initial, frozen, batch.input_ids, batch.attention_mask)
    np.testing.assert_allclose(zeroed, base, atol=1e-6)
    assert np.abs(np.asarray(trained) - np.asarray(base)).max() > 1e-4


def test_critic_step_reduces_value_loss_and_values_align():
    mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    batch = policy_batch()
    critic_cfg = CriticConfig(optim=OptimConfig(lr=3e-3))
    returns = np.where(batch.loss_mask > 0, 1.0, 0.0).astype(np.float32)
    with jax.set_mesh(mesh):
        model = create_sharded(lambda: Critic(CONFIG, rngs=nnx.Rngs(1)), mesh)
        graphdef, trainable, frozen = split_trainable(model, lora=False)
        values = jax.jit(make_value_fn(graphdef, 2))(trainable, frozen, batch.input_ids, batch.attention_mask)
        full = model(jnp.asarray(batch.input_ids), jnp.asarray(batch.attention_mask))[0]
        np.testing.assert_allclose(values, full[:, :-1], atol=1e-5)
        tx = make_optimizer(critic_cfg.optim, critic_cfg.grad_clip)
        state = init_train_state(trainable, tx, jax.random.key(0), mesh)
        step = compile_step(make_critic_step(graphdef, tx, critic_cfg, 2), state, shardings_of(frozen),
                            batch_sharding(mesh, 2))
        critic_batch = CriticBatch(batch.input_ids, batch.attention_mask, batch.loss_mask,
                                   np.asarray(values), returns)
        losses = []
        for _ in range(4):
            state, m = step(state, frozen, shard_batch(critic_batch, mesh))
            losses.append(float(m["critic/vf_loss"]))
    assert losses[-1] < losses[0]
    assert m["critic/grad_norm"] > 0 and m["critic/lr"] == pytest.approx(3e-3)


def test_critic_loss_is_ragens_micro_batch_token_mean():
    """Default critic aggregation = RAGEN HEAD/V2: masked token mean per one-trajectory micro-batch, averaged."""
    mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    batch = policy_batch(3)
    critic_cfg = CriticConfig()
    rng = np.random.default_rng(4)
    returns = rng.normal(size=batch.loss_mask.shape).astype(np.float32)
    with jax.set_mesh(mesh):
        model = create_sharded(lambda: Critic(CONFIG, rngs=nnx.Rngs(1)), mesh)
        graphdef, trainable, frozen = split_trainable(model, lora=False)
        values = np.asarray(model(jnp.asarray(batch.input_ids), jnp.asarray(batch.attention_mask))[0][:, :-1])
        old_values = (values + rng.normal(0, 0.6, size=values.shape)).astype(np.float32)
        tx = make_optimizer(critic_cfg.optim, critic_cfg.grad_clip)
        state = init_train_state(trainable, tx, jax.random.key(0), mesh)
        step = compile_step(make_critic_step(graphdef, tx, critic_cfg, 2), state, shardings_of(frozen),
                            batch_sharding(mesh, 2))
        _, m = step(state, frozen, shard_batch(CriticBatch(batch.input_ids, batch.attention_mask, batch.loss_mask,
                                                           old_values, returns), mesh))
    micro_losses = []  # verl dp_critic with ppo_micro_batch_size_per_gpu=1: one trajectory per micro-batch
    for v, old, r, mask in zip(values, old_values, returns, batch.loss_mask):
        clipped = np.clip(v, old - 0.5, old + 0.5)
        errors = np.maximum((v - r) ** 2, (clipped - r) ** 2)
        micro_losses.append(0.5 * (errors * mask).sum() / (mask.sum() + 1e-8))
    want = np.sum(micro_losses) / len(micro_losses)  # each micro-batch loss / gradient_accumulation
    token_mean = 0.5 * sum(np.maximum((v - r) ** 2, (np.clip(v, o - 0.5, o + 0.5) - r) ** 2)[k].sum()
                           for v, o, r, k in zip(values, old_values, returns, batch.loss_mask > 0)) / batch.loss_mask.sum()
    assert critic_cfg.loss_agg_mode == "seq-mean-token-mean"
    np.testing.assert_allclose(float(m["critic/vf_loss"]), want, rtol=1e-4)
    assert abs(want - token_mean) > 1e-3 * abs(want)  # the batch tells the two aggregations apart
