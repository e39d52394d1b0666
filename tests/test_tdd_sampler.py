"""TDD sampler against NumPy DDIM / DPM-Solver++ loops driven by a tiny real NNX ε-network."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tdd_jax import schedules as sch
from tdd_jax.sampler import (Conditioning, classifier_free_guidance, dynamic_threshold, guided_eps,
                             make_sampling_plan, module_eps_fn, tdd_sample)
from tdd_tiny_eps import build_tiny_eps_net

ABAR = sch.alphas_cumprod_from_config({"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012})
A64 = np.asarray(ABAR, np.float64)


@pytest.fixture(scope="module")
def setup():
    model = build_tiny_eps_net()
    rng = np.random.default_rng(0)
    cond = Conditioning(jnp.asarray(rng.normal(size=(2, 3, 8)), jnp.float32),
                        {"text_embeds": jnp.asarray(rng.normal(size=(2, 8)), jnp.float32)})
    uncond = Conditioning(jnp.zeros((2, 3, 8)), {"text_embeds": jnp.zeros((2, 8))})
    x_T = jnp.asarray(rng.normal(size=(2, 8, 8, 4)), jnp.float32)
    eps_fn = module_eps_fn(model)
    eps_np = jax.jit(lambda x, t, c: eps_fn(x, jnp.full((2,), t, jnp.int32), c))
    sample = jax.jit(lambda x, plan, key, u, g: tdd_sample(eps_fn, x, cond, plan, key, u, g))
    return model, cond, uncond, x_T, eps_np, sample


def numpy_tdd(eps_np, cond, x, timesteps, eta, key, clip_steps=()):
    """TDDScheduler.step in DPM-Solver++ form, x_s = (σ_s/σ_t)·x − α_s·(e^{−h} − 1)·x̂0, then re-noising."""
    x = np.asarray(x, np.float64)
    keys = jax.random.split(key, len(timesteps))
    for i, t in enumerate(timesteps):
        eps = np.asarray(eps_np(jnp.asarray(x, jnp.float32), int(t), cond), np.float64)
        alpha_t, sigma_t = np.sqrt(A64[t]), np.sqrt(1 - A64[t])
        x0 = (x - sigma_t * eps) / alpha_t
        if i in clip_steps:
            x0 = np.clip(x0, -1, 1)
        if i == len(timesteps) - 1:
            return x0
        s = int(np.floor((1 - eta) * timesteps[i + 1]))
        alpha_s, sigma_s = np.sqrt(A64[s]), np.sqrt(1 - A64[s])
        h = np.log(alpha_s / sigma_s) - np.log(alpha_t / sigma_t)
        x = (sigma_s / sigma_t) * x - alpha_s * (np.exp(-h) - 1.0) * x0
        ratio = A64[timesteps[i + 1]] / A64[s]
        z = np.asarray(jax.random.normal(keys[i], x.shape), np.float64)
        x = np.sqrt(ratio) * x + np.sqrt(1 - ratio) * z


def numpy_ddim(eps_np, cond, x, timesteps):
    """Plain deterministic DDIM (Song et al. 2021, eq. 12 with σ = 0), ending at x̂0."""
    x = np.asarray(x, np.float64)
    for i, t in enumerate(timesteps):
        eps = np.asarray(eps_np(jnp.asarray(x, jnp.float32), int(t), cond), np.float64)
        x0 = (x - np.sqrt(1 - A64[t]) * eps) / np.sqrt(A64[t])
        a_prev = A64[timesteps[i + 1]] if i + 1 < len(timesteps) else 1.0
        x = np.sqrt(a_prev) * x0 + np.sqrt(1 - a_prev) * eps
    return x


def test_plan_worked_example():
    plan = make_sampling_plan(ABAR, num_steps=4, eta=0.2)
    assert list(np.asarray(plan.timesteps)) == [999, 751, 499, 251]
    np.testing.assert_allclose(plan.alpha_bar_s, np.append(A64[[600, 399, 200]], 1.0), rtol=1e-6)
    np.testing.assert_allclose(plan.alpha_bar_next, np.append(A64[[751, 499, 251]], 1.0), rtol=1e-6)
    assert not np.any(plan.threshold)
    assert list(np.asarray(make_sampling_plan(ABAR, 4, 0.2, t_l=1).threshold)) == [True, True, False, False]
    with pytest.raises(ValueError, match="t_l"):
        make_sampling_plan(ABAR, 4, 0.2, t_l=-2)


def test_eta_zero_is_plain_ddim(setup):
    _, cond, _, x_T, eps_np, sample = setup
    plan = make_sampling_plan(ABAR, num_steps=4, eta=0.0)
    out = sample(x_T, plan, jax.random.key(0), None, 1.0)
    np.testing.assert_allclose(out, numpy_ddim(eps_np, cond, x_T, [999, 751, 499, 251]), rtol=1e-4, atol=2e-4)


def test_eta_renoising_matches_dpm_solver_form(setup):
    _, cond, _, x_T, eps_np, sample = setup
    plan = make_sampling_plan(ABAR, num_steps=4, eta=0.3)
    key = jax.random.key(7)
    out = sample(x_T, plan, key, None, 1.0)
    expected = numpy_tdd(eps_np, cond, x_T, [999, 751, 499, 251], 0.3, key)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=2e-4)
    assert not np.allclose(out, sample(x_T, plan, jax.random.key(8), None, 1.0), atol=1e-3)


def test_x0_clipping_only_on_configured_steps(setup):
    _, cond, _, x_T, eps_np, sample = setup
    key = jax.random.key(3)
    big = 3.0 * x_T  # x̂0 leaves [−1, 1] on every step
    outs = {}
    for t_l in (-1, 0, 1):
        plan = make_sampling_plan(ABAR, num_steps=4, eta=0.2, t_l=t_l)
        outs[t_l] = np.asarray(sample(big, plan, key, None, 1.0))
        expected = numpy_tdd(eps_np, cond, big, [999, 751, 499, 251], 0.2, key, clip_steps=range(t_l + 1))
        np.testing.assert_allclose(outs[t_l], expected, rtol=1e-4, atol=3e-4)
    assert not np.allclose(outs[-1], outs[0], atol=1e-3) and not np.allclose(outs[0], outs[1], atol=1e-3)


def test_dynamic_threshold_vs_numpy():
    x0 = np.random.default_rng(1).normal(scale=2.0, size=(3, 4, 4, 2)).astype(np.float32)
    np.testing.assert_allclose(dynamic_threshold(x0), np.clip(x0, -1, 1), atol=1e-6)
    q = np.clip(np.quantile(np.abs(x0).reshape(3, -1), 0.995, axis=1), 1.0, 1.5)[:, None, None, None]
    np.testing.assert_allclose(dynamic_threshold(x0, max_value=1.5), np.clip(x0, -q, q) / q, atol=1e-6)


def test_cfg_vs_separate_passes(setup):
    _, cond, uncond, x_T, eps_np, sample = setup
    eps_c = np.asarray(eps_np(x_T, 999, cond), np.float64)
    eps_u = np.asarray(eps_np(x_T, 999, uncond), np.float64)
    t = jnp.full((2,), 999, jnp.int32)
    model_fn = module_eps_fn(setup[0])
    np.testing.assert_allclose(guided_eps(model_fn, x_T, t, cond, uncond, 1.7), eps_u + 1.7 * (eps_c - eps_u),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(classifier_free_guidance(2.0, 1.0, 4.5), 5.5)
    plan = make_sampling_plan(ABAR, num_steps=4, eta=0.0)
    key = jax.random.key(0)
    np.testing.assert_allclose(sample(x_T, plan, key, uncond, 1.0), sample(x_T, plan, key, None, 1.0),
                               rtol=1e-5, atol=1e-5)
    guided = sample(x_T, plan, key, uncond, 2.0)
    assert not np.allclose(guided, sample(x_T, plan, key, None, 1.0), atol=1e-3)
    # a batch-1 negative embedding replacing only text_embeds (SDXL keeps each row's time_ids) is the same
    single = Conditioning(jnp.zeros((1, 3, 8)), {"text_embeds": jnp.zeros((1, 8))})
    np.testing.assert_allclose(sample(x_T, plan, key, single, 2.0), guided, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="uncond"):
        tdd_sample(model_fn, x_T, cond, plan, key, None, 2.0)
    # as diffusers (do_classifier_free_guidance = guidance_scale > 1): no CFG at or below 1, uncond or not
    unguided = np.asarray(tdd_sample(model_fn, x_T, cond, plan, key))
    for scale in (0.5, 1.0):
        np.testing.assert_array_equal(tdd_sample(model_fn, x_T, cond, plan, key, uncond, scale), unguided)
    with pytest.raises(ValueError, match="sample_max_value"):
        tdd_sample(model_fn, x_T, cond, plan, key, sample_max_value=0.5)
