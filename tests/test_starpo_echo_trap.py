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
