"""TDD distillation step: pieces vs NumPy, one step recomputed by hand, sharded = 1 device, frozen teacher."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from runtime.mesh import MeshConfig, make_mesh
from runtime.sharding import shard_batch
from tdd_jax import schedules as sch
from tdd_jax.distill import (DistillBatch, DistillConfig, DistillSample, Unconditional, compile_distill_step,
                             draw_distill_sample, draw_latents, init_distill_state, l2_loss, make_distill_step,
                             pseudo_huber_loss, split_model, teacher_ddim_step, unconditional_embedding)
from tdd_jax.sampler import Conditioning, module_eps_fn, replace_conditioning
from tdd_jax.targets import make_selector
from tdd_tiny_eps import build_tiny_eps_net

ABAR = sch.alphas_cumprod_from_config({"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012})
A64 = np.asarray(ABAR, np.float64)
SCHEDULE = DistillConfig().schedule(ABAR)
B = 8


def make_inputs():
    rng = np.random.default_rng(0)
    f32 = lambda *shape: rng.normal(size=shape).astype(np.float32)
    cond = Conditioning(f32(B, 3, 8), {"text_embeds": f32(B, 8), "time_ids": f32(B, 6)})
    empty = Conditioning(f32(1, 3, 8), {"text_embeds": f32(1, 8)})
    return DistillBatch(f32(B, 8, 8, 4), cond), Unconditional(empty, unconditional_embedding(empty, "zeros"))


def run_step(mesh_shape, config, lora=True, steps=2, nan_steps=()):
    """``steps`` compiled steps on one batch; returns the params and state after each step and the metrics.

    Steps in ``nan_steps`` get the batch with one latent element set to NaN.
    """
    data, fsdp, tensor = mesh_shape
    mesh = make_mesh(MeshConfig(data, fsdp, tensor), jax.devices()[: data * fsdp * tensor])
    batch, uncond = make_inputs()
    with jax.set_mesh(mesh):
        model = build_tiny_eps_net(mesh=mesh)
        graphdef, params, frozen = split_model(model, lora)
        frozen_before = jax.device_get(frozen)
        state = init_distill_state(params, config, jax.random.key(42), mesh)
        nan_latents = batch.latents.copy()
        nan_latents[0, 0, 0, 0] = np.nan
        batches = [shard_batch(batch._replace(latents=nan_latents) if i in nan_steps else batch, mesh)
                   for i in range(steps)]
        raw_step = chex.assert_max_traces(make_distill_step(graphdef, SCHEDULE, config), n=1)
        step = compile_distill_step(raw_step, state, frozen, batches[0], mesh)
        metrics, states = [], [jax.device_get(state)]
        for batch in batches:
            state, m = step(state, frozen, uncond, batch)
            states.append(jax.device_get(state))
            metrics.append(jax.device_get(m))
    chex.clear_trace_counter()
    return dict(history=[s.params for s in states], frozen_before=frozen_before, frozen=jax.device_get(frozen),
                state=states[-1], states=states, metrics=metrics)


# ε = 1 makes the first Adam update ≈ lr·g, so float noise in near-zero gradients cannot flip its sign
CONFIG = DistillConfig(learning_rate=1.0, adam_epsilon=1.0)


@pytest.fixture(scope="module")
def reference():
    return run_step((1, 1, 1), CONFIG)


def test_losses_vs_hand_values():
    pred, target = np.array([0.0, 0.003, -0.004]), np.zeros(3)
    c = 0.004
    expected = np.mean([0.0, np.sqrt(0.003 ** 2 + c ** 2) - c, np.sqrt(0.004 ** 2 + c ** 2) - c])
    np.testing.assert_allclose(pseudo_huber_loss(pred, target, c), expected, rtol=1e-6)
    np.testing.assert_allclose(pseudo_huber_loss(np.array([0.005]), np.zeros(1), c), 0.0024031242, rtol=1e-6)
    np.testing.assert_allclose(l2_loss(np.array([1.0, -2.0]), np.zeros(2)), 2.5)


def test_config_errors_name_the_field():
    assert list(np.asarray(SCHEDULE.candidates))[:3] == [0, 127, 143] and SCHEDULE.skip == 4
    assert DistillConfig(num_ddim_timesteps=50).schedule(ABAR).skip == 20
    for field, value in [("num_ddim_timesteps", 0), ("num_inference_steps_max", 3), ("selector", "pcm"),
                         ("loss_type", "l1"), ("teacher_uncond", "none"), ("w_max", 1.0),
                         ("proportion_empty_prompts", 1.5), ("ema_decay", 1.0), ("num_microbatches", 0)]:
        with pytest.raises(ValueError, match=f"DistillConfig.{field}"):
            DistillConfig(**{field: value})


def test_decoupled_guidance_draws():
    batch, uncond = make_inputs()
    n = 4000
    big = DistillBatch(np.zeros((n, 2, 2, 1), np.float32),
                       jax.tree.map(lambda x: np.repeat(x, n // B, axis=0), batch.cond))
    select = make_selector("tdd", SCHEDULE, 0.3)
    sample = jax.jit(lambda k, b: draw_distill_sample(k, b, uncond.student, SCHEDULE, select, DistillConfig()))(
        jax.random.key(0), big)
    replaced = np.all(np.asarray(sample.cond.context) == uncond.student.context, axis=(1, 2))
    assert abs(replaced.mean() - 0.2) < 4 * np.sqrt(0.2 * 0.8 / n)
    np.testing.assert_array_equal(np.all(np.asarray(sample.cond.added["text_embeds"])
                                         == uncond.student.added["text_embeds"], axis=1), replaced)
    np.testing.assert_array_equal(sample.cond.added["time_ids"], big.cond.added["time_ids"])
    t_start, t_n, s = (np.asarray(a) for a in (sample.t_start, sample.t_n, sample.s))
    assert np.all(np.isin(t_start, np.arange(1, 251) * 4 - 1))
    np.testing.assert_array_equal(t_n, np.maximum(t_start - 4, 0))
    assert np.all(s <= t_n) and np.all(s >= 0)
    np.testing.assert_allclose(sample.w, 3.5)
    zeros = unconditional_embedding(uncond.student, "zeros")
    mixed = replace_conditioning(batch.cond, zeros, jnp.arange(B) < 3)
    assert np.all(np.asarray(mixed.context[:3]) == 0)
    np.testing.assert_array_equal(mixed.context[3:], batch.cond.context[3:])


def test_teacher_cfg_ddim_step_vs_numpy_lcm_form():
    batch, uncond = make_inputs()
    eps_fn = jax.jit(module_eps_fn(build_tiny_eps_net(seed=1)))
    t_start = jnp.asarray(np.arange(B) * 100 + 99, jnp.int32)
    t_n = t_start - 4
    w = jnp.linspace(0.0, 7.0, B)
    x = jnp.asarray(batch.latents)
    sample = DistillSample(batch.cond, t_start, t_n, jnp.zeros_like(t_n), None, w)
    got = jax.jit(teacher_ddim_step, static_argnums=0)(eps_fn, x, sample, uncond.teacher, ABAR)
    zeros = Conditioning(jnp.zeros_like(batch.cond.context),
                         {"text_embeds": jnp.zeros((B, 8)), "time_ids": batch.cond.added["time_ids"]})
    eps_c = np.asarray(eps_fn(x, t_start, batch.cond), np.float64)
    eps_u = np.asarray(eps_fn(x, t_start, zeros), np.float64)
    col = lambda a: np.asarray(a, np.float64)[:, None, None, None]
    a_t, a_n, wc = col(A64[np.asarray(t_start)]), col(A64[np.asarray(t_n)]), col(w)
    x0_c = (np.asarray(x) - np.sqrt(1 - a_t) * eps_c) / np.sqrt(a_t)
    x0_u = (np.asarray(x) - np.sqrt(1 - a_t) * eps_u) / np.sqrt(a_t)
    x0 = x0_c + wc * (x0_c - x0_u)
    eps = eps_c + wc * (eps_c - eps_u)
    np.testing.assert_allclose(got, np.sqrt(a_n) * x0 + np.sqrt(1 - a_n) * eps, rtol=2e-4, atol=2e-4)


def test_step_loss_recomputed_from_its_pieces(reference):
    """The step's loss equals pseudo-Huber(f_student, sg f_online(teacher DDIM step)) recomputed here."""
    config = CONFIG
    batch, uncond = make_inputs()
    model = build_tiny_eps_net()
    graphdef, params, frozen = split_model(model)
    _, key = jax.random.split(jax.random.key(42))
    sample = draw_distill_sample(key, DistillBatch(jnp.asarray(batch.latents), jax.tree.map(jnp.asarray, batch.cond)),
                                 uncond.student, SCHEDULE, make_selector("tdd", SCHEDULE, 0.3), config)
    student = jax.jit(module_eps_fn(model))
    teacher = module_eps_fn(nnx.merge(graphdef, jax.tree.map(jnp.zeros_like, params), frozen.base))
    col = lambda a: np.asarray(a, np.float64)[:, None, None, None]
    a_start, a_n, a_s = (col(A64[np.asarray(t)]) for t in (sample.t_start, sample.t_n, sample.s))
    x_start = np.sqrt(a_start) * batch.latents + np.sqrt(1 - a_start) * np.asarray(sample.noise, np.float64)
    x_n = np.asarray(jax.jit(teacher_ddim_step, static_argnums=0)(
        teacher, jnp.asarray(x_start, jnp.float32), sample, uncond.teacher, ABAR))

    def f(x, t, a_from):
        eps = np.asarray(student(jnp.asarray(x, jnp.float32), t, sample.cond), np.float64)
        return np.sqrt(a_s) * (x - np.sqrt(1 - a_from) * eps) / np.sqrt(a_from) + np.sqrt(1 - a_s) * eps

    diff = f(x_start, sample.t_start, a_start) - f(x_n, sample.t_n, a_n)
    expected = np.mean(np.sqrt(diff ** 2 + 0.001 ** 2) - 0.001)
    np.testing.assert_allclose(reference["metrics"][0]["loss"], expected, rtol=2e-3)
    assert int(reference["state"].step) == 2


def test_only_lora_changes_and_teacher_is_frozen(reference):
    jax.tree.map(np.testing.assert_array_equal, reference["frozen"], reference["frozen_before"])
    first, last = reference["history"][0], reference["history"][-1]
    changed = jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(a != b)), last, first))
    assert len(changed) == 6 and all(changed)  # A and B of three LoRA convs
    variables = jax.tree.leaves(last, is_leaf=lambda x: isinstance(x, nnx.Variable))
    assert all(isinstance(v, nnx.LoRAParam) for v in variables)


# (2, 2, 2) with one row per device is avoided: XLA CPU (jax 0.10.2) then returns wrong conv weight
# gradients even for a plain two-conv network, independent of this code.
@pytest.mark.parametrize("mesh_shape, microbatches", [((2, 2, 2), 1), ((1, 2, 4), 2)])
def test_sharded_and_microbatched_step_equals_single_device(reference, mesh_shape, microbatches):
    out = run_step(mesh_shape, dataclasses.replace(CONFIG, num_microbatches=microbatches))
    for got, want in zip(out["metrics"], reference["metrics"]):
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    assert out["metrics"][0]["loss"] != out["metrics"][1]["loss"]  # new draws and new params on step 2
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5),
                 out["state"].params, reference["state"].params)


def test_full_finetune_with_ema_and_l2():
    config = DistillConfig(learning_rate=1e-3, loss_type="l2", ema_decay=0.9, selector="lcm")
    out = run_step((1, 1, 1), config, lora=False)
    p0, p1, p2 = out["history"]
    jax.tree.map(np.testing.assert_array_equal, out["frozen"].teacher, p0)
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(a != b)), p2, p0)))
    jax.tree.map(lambda e, a, b, c: np.testing.assert_allclose(e, 0.81 * a + 0.09 * b + 0.1 * c, rtol=1e-5, atol=1e-6),
                 out["state"].ema_params, p0, p1, p2)
    with pytest.raises(ValueError, match="num_microbatches"):
        run_step((1, 1, 1), dataclasses.replace(config, num_microbatches=3))


def test_non_finite_steps_leave_params_moments_and_ema_unchanged():
    """Steps 2 and 3 see a NaN latent: skipped and counted; step 4 is finite again and updates.

    Same config, mesh and shapes as ``test_full_finetune_with_ema_and_l2``, so the compiled step is reused.
    """
    config = DistillConfig(learning_rate=1e-3, loss_type="l2", ema_decay=0.9, selector="lcm")
    out = run_step((1, 1, 1), config, lora=False, steps=4, nan_steps=(1, 2))
    counters = [(int(m["numerics/non_finite_steps"]), int(m["numerics/consecutive_non_finite"]))
                for m in out["metrics"]]
    assert counters == [(0, 0), (1, 1), (2, 2), (2, 0)]
    assert [bool(np.isnan(m["loss"])) for m in out["metrics"]] == [False, True, True, False]
    s1, s2, s3, s4 = out["states"][1:]
    trainable = lambda s: (s.params, s.opt_state.inner_state, s.ema_params)
    for skipped in (s2, s3):
        jax.tree.map(np.testing.assert_array_equal, trainable(skipped), trainable(s1))
    assert not any(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.all(a == b)), s1.ema_params, s1.params)))
    assert int(s3.step) == 3
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(a != b)), s4.params, s3.params)))
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(trainable(s4)))
    jax.tree.map(lambda e, a, b: np.testing.assert_allclose(e, 0.9 * a + 0.1 * b, rtol=1e-6, atol=1e-7),
                 s4.ema_params, s3.ema_params, s4.params)


def test_latents_are_drawn_from_the_cached_posterior_in_every_step():
    batch, uncond = make_inputs()
    logvar = np.log(np.linspace(0.25, 4.0, batch.latents.size, dtype=np.float32)).reshape(batch.latents.shape)
    posterior = batch._replace(latents_logvar=logvar)
    key = jax.random.key(3)
    np.testing.assert_array_equal(draw_latents(key, batch), batch.latents)  # fixed latents: no draw
    draws = np.asarray(jax.vmap(lambda k: draw_latents(k, posterior))(jax.random.split(key, 4000)))
    std = np.exp(logvar / 2)
    assert np.all(np.abs(draws.mean(0) - batch.latents) < 5 * std / np.sqrt(4000))
    np.testing.assert_allclose(draws.std(0), std, rtol=0.1)
    # the step uses the draw: a near-zero variance is the fixed-latent step, a unit one is not
    mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    with jax.set_mesh(mesh):
        graphdef, params, frozen = split_model(build_tiny_eps_net(mesh=mesh), True)
        step = jax.jit(make_distill_step(graphdef, SCHEDULE, CONFIG))
        state = init_distill_state(params, CONFIG, jax.random.key(42), mesh)
        loss = lambda b: float(step(state, frozen, uncond, b)[1]["loss"])
        fixed = loss(batch)
        np.testing.assert_allclose(loss(batch._replace(latents_logvar=np.full_like(logvar, -30.0))), fixed, rtol=1e-5)
        assert abs(loss(batch._replace(latents_logvar=np.zeros_like(logvar))) - fixed) > 1e-3 * abs(fixed)
