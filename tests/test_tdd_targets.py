"""Target-timestep selectors against an independent NumPy version of the reference's ``select_s``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tdd_jax import schedules as sch
from tdd_jax.targets import make_selector, select_target_timestep

MERGED = np.array([0, 127, 143, 167, 199, 251, 287, 335, 375, 399, 431, 499, 571, 599, 627, 667, 715, 751, 799,
                   835, 859, 875])
GRID = np.arange(1, 251) * 4 - 1
N = 20000  # one batch size everywhere, so each selector compiles once
select_jit = jax.jit(select_target_timestep)


def numpy_window(t_n):
    """Candidates of the reference for one t_n: merged values in [max(τ_max − 260, 0), τ_max]."""
    tau_max = MERGED[MERGED <= t_n].max()
    return MERGED[(MERGED >= max(tau_max - 260, 0)) & (MERGED <= tau_max)]


def numpy_select_s(rng, t_n, s_ratio):
    """Per-sample loop as in the reference: uniform τ from the window, then floor((1 − u·r)·τ)."""
    out = []
    for t in t_n:
        window = numpy_window(t)
        tau = window[rng.integers(len(window))]
        out.append(int(np.floor((1 - rng.random() * s_ratio) * tau)))
    return np.array(out)


def exact_pmf(t_n, s_ratio):
    """P(s) for one t_n: mean over τ of the length of {u ∈ [0, 1): floor((1 − u·r)·τ) = s}."""
    pmf = np.zeros(1000)
    window = numpy_window(t_n)
    for tau in window:
        if tau == 0:
            pmf[0] += 1.0
            continue
        for s in range(int(np.floor((1 - s_ratio) * tau)), tau + 1):
            lo, hi = (tau - s - 1) / (s_ratio * tau), (tau - s) / (s_ratio * tau)
            pmf[s] += max(0.0, min(hi, 1.0) - max(lo, 0.0))
    return pmf / len(window)


@pytest.mark.parametrize("t_n, expected", [
    (123, [0]),
    (251, [0, 127, 143, 167, 199, 251]),
    (751, [499, 571, 599, 627, 667, 715, 751]),
    (995, [627, 667, 715, 751, 799, 835, 859, 875]),
])
def test_windows_match_spec_examples(t_n, expected):
    assert list(numpy_window(t_n)) == expected
    s = np.asarray(select_jit(jax.random.key(0), jnp.full((N,), t_n), MERGED, 0.0))
    values, counts = np.unique(s, return_counts=True)
    assert list(values) == expected
    np.testing.assert_allclose(counts / N, 1 / len(expected), atol=0.015)


@pytest.mark.parametrize("t_n", [0, 251, 751, 995])
def test_tdd_distribution_matches_numpy_reference(t_n):
    n = N
    s = np.asarray(select_jit(jax.random.key(1), jnp.full((n,), t_n), MERGED, 0.3))
    cdf = np.cumsum(exact_pmf(t_n, 0.3))
    ks = np.max(np.abs(np.searchsorted(np.sort(s), np.arange(1000), side="right") / n - cdf))
    assert ks < 1.95 / np.sqrt(n)  # KS critical value at 0.1%
    loop = numpy_select_s(np.random.default_rng(2), np.full(n, t_n), 0.3)
    ks_loop = np.max(np.abs(np.searchsorted(np.sort(loop), np.arange(1000), side="right") / n - cdf))
    assert ks_loop < 1.95 / np.sqrt(n)
    assert np.abs(s.mean() - loop.mean()) < 5 * np.sqrt(s.var() / n + loop.var() / n) + 1e-9


def test_tdd_offset_range_and_s_never_exceeds_t_n():
    t_n = np.maximum(GRID - 4, 0)
    t_rep = np.tile(t_n, N // len(t_n))
    s = np.asarray(select_jit(jax.random.key(3), jnp.asarray(t_rep), MERGED, 0.3))
    assert np.all(s >= 0) and np.all(s <= t_rep)
    assert np.all(s[t_rep <= 123] == 0)
    windows = {t: numpy_window(t) for t in t_n}
    assert all(np.floor(0.7 * windows[t].min()) <= v <= windows[t].max() for t, v in zip(t_rep, s))


def test_tcd_and_lcm_selectors():
    schedule = sch.make_tdd_schedule(sch.alphas_cumprod_from_config({"beta_schedule": "scaled_linear",
                                                                      "beta_start": 0.00085, "beta_end": 0.012}))
    tcd = jax.jit(make_selector("tcd", schedule))
    s = np.asarray(tcd(jax.random.key(4), jnp.full((N,), 19)))
    values, counts = np.unique(s, return_counts=True)
    assert list(values) == [0, 3, 7, 11, 15, 19]
    np.testing.assert_allclose(counts / N, 1 / 6, atol=0.015)
    grid = np.tile(GRID, N // len(GRID))
    s_big = np.asarray(tcd(jax.random.key(5), jnp.asarray(grid)))
    assert np.all(s_big <= grid) and np.all(np.isin(s_big, np.concatenate([[0], GRID])))
    lcm = make_selector("lcm", schedule)
    assert np.all(np.asarray(lcm(jax.random.key(0), jnp.asarray(GRID))) == 0)
    tdd = jax.jit(make_selector("tdd", schedule))
    assert np.all(np.asarray(tdd(jax.random.key(6), jnp.asarray(grid))) <= grid)
    with pytest.raises(ValueError, match="selector"):
        make_selector("pcm", schedule)
    with pytest.raises(ValueError, match="s_ratio"):
        make_selector("tdd", schedule, s_ratio=1.5)
