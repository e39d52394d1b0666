"""Echo Trap warnings fire on reward-std collapse and gradient spikes, not on steady runs."""

from starpo_jax.echo_trap import EchoTrapMonitor


def test_steady_run_gives_no_warning():
    monitor = EchoTrapMonitor(warmup=3)
    assert all(not monitor.update(i, {"rollout/in_group_std": 0.4 + 0.01 * (i % 3), "actor/grad_norm": 1.0 + 0.1 * (i % 2)})
               for i in range(30))


def test_std_collapse_and_grad_spike_are_reported():
    monitor = EchoTrapMonitor(collapse_ratio=0.1, spike_factor=5.0, warmup=3)
    for i in range(5):
        assert monitor.update(i, {"rollout/in_group_std": 0.5, "actor/grad_norm": 1.0}) == []
    warnings = monitor.update(5, {"rollout/in_group_std": 0.04, "actor/grad_norm": 6.0})
    assert len(warnings) == 2
    assert "in-group reward std 0.04 fell below 0.1 x its peak 0.5" in warnings[0]
    assert "actor/grad_norm 6 spiked" in warnings[1]


def collapse_row(mi: float, entropy: float, family: str = "collapse_trajectory_sample") -> dict:
    return {f"{family}/mi_zscore_ema": mi, f"{family}/conditional_entropy_est": entropy}


def test_template_collapse_is_mi_falling_while_entropy_stays_and_survives_a_resume():
    monitor = EchoTrapMonitor(mi_ratio=0.5, entropy_ratio=0.8)
    assert monitor.update(1, collapse_row(1.0, 2.0)) == []
    assert monitor.update(2, collapse_row(2.0, 2.0)) == []  # the new peak
    assert monitor.update(3, {"actor/grad_norm": 1.0}) == []  # steps without diagnostics change nothing
    assert monitor.update(4, collapse_row(0.9, 0.5)) == []  # entropy collapsed too: not template collapse
    resumed = EchoTrapMonitor(mi_ratio=0.5, entropy_ratio=0.8)
    resumed.load_state_dict(monitor.state_dict())
    warnings = resumed.update(5, collapse_row(0.9, 1.9))
    assert len(warnings) == 1 and "mi_zscore_ema 0.9 fell below 0.5 x its peak 2" in warnings[0]
    assert resumed.update(6, collapse_row(1.1, 1.9)) == []  # above half the peak
    older = EchoTrapMonitor()
    older.load_state_dict({"seen": 3, "max_std": 0.5, "grad_norms": []})  # a checkpoint from before the field
    assert older.update(7, collapse_row(0.1, 1.0, "collapse_first_turn_sample")) == []
