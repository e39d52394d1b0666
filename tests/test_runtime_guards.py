"""Non-finite updates are skipped and counted; repeated ones stop the run; spikes are flagged."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from runtime.guards import NonFiniteError, NonFiniteGuard, SpikeDetector, non_finite_metrics, skip_non_finite


def test_non_finite_gradients_leave_params_and_state_unchanged():
    tx = skip_non_finite(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(0.1)))
    params = {"w": jnp.array([1.0, -2.0])}
    state = tx.init(params)
    good = {"w": jnp.array([0.5, 0.5])}
    updates, state = tx.update(good, state, params)
    params = optax.apply_updates(params, updates)
    snapshot = (np.asarray(params["w"]), state)
    for i in range(1, 6):
        updates, state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, state, params)
        np.testing.assert_array_equal(np.asarray(updates["w"]), 0.0)
        metrics = non_finite_metrics(state)
        assert int(metrics["numerics/consecutive_non_finite"]) == i
        assert int(metrics["numerics/non_finite_steps"]) == i
    np.testing.assert_array_equal(np.asarray(state.inner_state[1][0].mu["w"]),
                                  np.asarray(snapshot[1].inner_state[1][0].mu["w"]))
    updates, state = tx.update(good, state, params)
    assert int(non_finite_metrics(state)["numerics/consecutive_non_finite"]) == 0
    assert int(non_finite_metrics(state)["numerics/non_finite_steps"]) == 5
    assert np.all(np.asarray(updates["w"]) != 0)


def test_guard_stops_after_max_consecutive():
    guard = NonFiniteGuard(max_consecutive=3)
    guard.check(10, {"numerics/consecutive_non_finite": 2})
    with pytest.raises(NonFiniteError, match="3 consecutive steps up to step 11"):
        guard.check(11, {"numerics/consecutive_non_finite": 3})
    with pytest.raises(ValueError, match="max_consecutive_non_finite"):
        NonFiniteGuard(0)


def test_spike_detector_uses_the_running_median():
    detector = SpikeDetector(window=4, factor=3.0, min_history=3)
    flags = [detector.update(v) for v in [1.0, 2.0, 100.0, 1.0, 1.5, 7.0, float("nan"), 20.0]]
    assert flags == [False, False, False, False, False, True, False, True]
