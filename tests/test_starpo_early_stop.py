"""RAGEN-2's early-stop triggers (ragen2.md §4.8)."""

from starpo_jax.early_stop import EarlyStop


def test_empty_batches_stop_after_the_configured_run_and_reset_on_a_kept_step():
    stop = EarlyStop(empty_stop_steps=3)
    assert stop.observe_filter(True, None)["rollout/consecutive_empty_after_filter_steps"] == 1
    stop.observe_filter(True, None)
    assert stop.observe_filter(False, 0.5)["rollout/consecutive_empty_after_filter_steps"] == 0
    for _ in range(2):
        assert "early_stopped/empty_filtered_steps" not in stop.observe_filter(True, None)
    assert stop.observe_filter(True, None)["early_stopped/empty_filtered_steps"] == 1.0 and stop.stopped
    never = EarlyStop(empty_stop_steps=0)
    assert not any("early_stopped" in k for _ in range(20) for k in never.observe_filter(True, None))


def test_reward_variance_collapse_needs_ten_steps_below_a_tenth_of_the_base():
    stop = EarlyStop(empty_stop_steps=5)
    for value in [1.0, 3.0] * 5:  # base 2.0 from the first ten non-empty steps
        stop.observe_filter(False, value)
    stop.observe_filter(True, None)  # empty steps do not enter the window
    for _ in range(9):
        assert "early_stopped/reward_variance_collapse" not in stop.observe_filter(False, 0.19)
    assert not stop.stopped
    assert "early_stopped/reward_variance_collapse" not in stop.observe_filter(False, 0.2)  # not below 0.2
    for _ in range(9):
        stop.observe_filter(False, 0.1)
    assert stop.observe_filter(False, 0.1)["early_stopped/reward_variance_collapse"] == 1.0


def test_low_validation_success_counts_per_tag_and_resets():
    stop = EarlyStop(empty_stop_steps=5)
    for _ in range(4):
        assert stop.observe_validation({"val-env/A/success": 0.0, "val-env/B/success": 0.5}) == {}
    assert stop.observe_validation({"val-env/A/success": 0.02}) == {}  # resets A
    for _ in range(4):
        stop.observe_validation({"val-env/A/success": 0.005})
    assert stop.observe_validation({"val-env/A/success": 0.0}) == {"early_stopped/low_validation_success": 1.0}
