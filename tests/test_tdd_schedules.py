"""TDD schedules: ᾱ, DDIM grid, inference schedules and candidate set equal tdd.md §2-3's lists."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from tdd_jax import schedules as sch

SDXL_SCHEDULER = {"_class_name": "EulerDiscreteScheduler", "beta_start": 0.00085, "beta_end": 0.012,
                  "beta_schedule": "scaled_linear", "num_train_timesteps": 1000, "prediction_type": "epsilon",
                  "sample_max_value": 1.0, "steps_offset": 1, "timestep_spacing": "leading"}

# tdd.md §3.2 and §3.3, N_ddim = 250
SPEC_SCHEDULES = {
    4: [999, 751, 499, 251],
    5: [999, 799, 599, 399, 199],
    6: [999, 835, 667, 499, 335, 167],
    7: [999, 859, 715, 571, 431, 287, 143],
    8: [999, 875, 751, 627, 499, 375, 251, 127],
}
SPEC_MERGED = [0, 127, 143, 167, 199, 251, 287, 335, 375, 399, 431, 499, 571, 599, 627, 667, 715, 751, 799,
               835, 859, 875]


def test_alphas_cumprod_matches_spec_table_and_diffusers(tmp_path):
    from diffusers import DDPMScheduler

    abar = np.asarray(sch.alphas_cumprod_from_config(SDXL_SCHEDULER))
    assert abar.shape == (1000,) and abar.dtype == np.float32
    spec = {0: 0.99915, 127: 0.85941, 251: 0.67215, 499: 0.27767, 751: 0.05572, 875: 0.01825, 999: 0.00466}
    for t, value in spec.items():
        assert abar[t] == pytest.approx(value, abs=6e-6), t
    ref = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012).alphas_cumprod.numpy()
    np.testing.assert_allclose(abar, ref, rtol=2e-5)

    folder = tmp_path / "teacher"
    (folder / "scheduler").mkdir(parents=True)
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(SDXL_SCHEDULER))
    np.testing.assert_array_equal(np.asarray(sch.alphas_cumprod_from_config(folder)), abar)
    np.testing.assert_array_equal(
        np.asarray(sch.alphas_cumprod_from_config(folder / "scheduler" / "scheduler_config.json")), abar)


def test_linear_betas_by_hand():
    abar = np.asarray(sch.alphas_cumprod_from_config({"beta_schedule": "linear", "beta_start": 0.1,
                                                        "beta_end": 0.3, "num_train_timesteps": 3}))
    np.testing.assert_allclose(abar, [0.9, 0.9 * 0.8, 0.9 * 0.8 * 0.7], rtol=1e-6)


@pytest.mark.parametrize("config, field", [
    ({"prediction_type": "v_prediction"}, "prediction_type"),
    ({"beta_schedule": "squaredcos_cap_v2"}, "beta_schedule"),
    ({"beta_start": 0.5, "beta_end": 0.1}, "beta_start"),
    ({"rescale_betas_zero_snr": True}, "rescale_betas_zero_snr"),
])
def test_bad_scheduler_config_names_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        sch.alphas_cumprod_from_config(config)


def test_ddim_grid_and_skip():
    grid, skip = sch.ddim_timesteps(1000, 250)
    assert skip == 4 and len(grid) == 250
    assert list(grid[:3]) == [3, 7, 11] and list(grid[-2:]) == [995, 999]
    grid50, skip50 = sch.ddim_timesteps(1000, 50)
    assert skip50 == 20 and list(grid50[:2]) == [19, 39] and grid50[-1] == 999
    with pytest.raises(ValueError, match="num_ddim_timesteps"):
        sch.ddim_timesteps(1000, 0)


@pytest.mark.parametrize("num_steps", sorted(SPEC_SCHEDULES))
def test_equidistant_schedules_equal_spec(num_steps):
    grid, _ = sch.ddim_timesteps(1000, 250)
    assert list(sch.inference_schedule(grid, num_steps)) == SPEC_SCHEDULES[num_steps]


def test_special_jump_schedules():
    grid, _ = sch.ddim_timesteps(1000, 250)
    assert list(sch.inference_schedule(grid, 5, special_jump=True)) == [999, 875, 751, 499, 251]
    assert list(sch.inference_schedule(grid, 6, special_jump=True)) == [999, 875, 751, 627, 499, 251]
    assert list(sch.inference_schedule(grid, 7, special_jump=True)) == [999, 875, 751, 627, 499, 375, 251]
    with pytest.raises(ValueError, match="num_steps"):
        sch.inference_schedule(grid, 4, special_jump=True)
    with pytest.raises(ValueError, match="num_ddim_timesteps=250"):
        sch.inference_schedule(sch.ddim_timesteps(1000, 50)[0], 5, special_jump=True)


def test_merged_candidates_equal_spec():
    grid, _ = sch.ddim_timesteps(1000, 250)
    assert list(sch.merged_candidates(grid, 4, 8)) == SPEC_MERGED
    schedule = sch.make_tdd_schedule(sch.alphas_cumprod_from_config(SDXL_SCHEDULER))
    assert schedule.skip == 4 and schedule.candidates.dtype == jnp.int32
    assert list(np.asarray(schedule.candidates)) == SPEC_MERGED


def test_sampling_targets_worked_example_and_float64():
    # tdd.md §11: N = 4, eta = 0.2 gives 600, 399, 200; eta = 0.6, N = 6 gives 334 (float64), not 333.
    assert list(sch.sampling_targets(np.array(SPEC_SCHEDULES[4]), 0.2)) == [600, 399, 200]
    assert list(sch.sampling_targets(np.array(SPEC_SCHEDULES[6]), 0.6)) == [334, 266, 199, 134, 66]
    with pytest.raises(ValueError, match="eta"):
        sch.sampling_targets(np.array(SPEC_SCHEDULES[4]), 1.0)


def test_ddim_jump_and_consistency_function_vs_numpy():
    rng = np.random.default_rng(0)
    x, eps = rng.normal(size=(2, 2, 3, 4, 4)).astype(np.float32)
    abar_t, abar_s = np.array([0.3, 0.05], np.float32), np.array([0.9, 0.6], np.float32)
    x0 = (x - np.sqrt(1 - abar_t)[:, None, None, None] * eps) / np.sqrt(abar_t)[:, None, None, None]
    expected = np.sqrt(abar_s)[:, None, None, None] * x0 + np.sqrt(1 - abar_s)[:, None, None, None] * eps
    np.testing.assert_allclose(sch.predicted_origin(x, eps, abar_t), x0, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sch.consistency_jump(x, eps, abar_t, abar_s), expected, rtol=1e-5, atol=1e-5)
    # boundary condition f(x, t, t) = x
    np.testing.assert_allclose(sch.consistency_jump(x, eps, abar_t, abar_t), x, rtol=1e-5, atol=1e-5)
    # forward noising with ᾱ_t/ᾱ_s = 0.25 by hand: 0.5·x_s + sqrt(0.75)·z
    z = rng.normal(size=x.shape).astype(np.float32)
    np.testing.assert_allclose(sch.renoise(x, z, jnp.float32(0.8), jnp.float32(0.2)),
                               0.5 * x + np.sqrt(0.75) * z, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sch.add_noise(x, z, jnp.float32(0.64)), 0.8 * x + 0.6 * z, rtol=1e-5, atol=1e-6)
