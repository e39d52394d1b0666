"""A StarPO update and TDD steps on two processes (gloo, 2 × 4 CPU devices) equal one process on the same
8-device mesh, and the two-process checkpoint restores in the one-process run."""

import os
import sys

import jax
import numpy as np

from test_runtime_distributed import free_port, run_processes

WORKER = os.path.join(os.path.dirname(__file__), "multiprocess_steps_worker.py")


def worker_env(devices: int) -> dict[str, str]:
    """The test session's JAX settings (fast compiles) for a worker with ``devices`` CPU devices."""
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                JAX_DISABLE_MOST_OPTIMIZATIONS=str(jax.config.values["jax_disable_most_optimizations"]))


def test_two_processes_equal_one_and_their_checkpoint_restores_in_one(tmp_path):
    port = free_port()
    commands = [([str(i), "2", str(port)], 4) for i in range(2)] + [(["0", "1", "0"], 8)]
    run_processes([([sys.executable, WORKER, *args, str(tmp_path)], worker_env(devices))
                   for args, devices in commands], timeout=400)
    single, multi, restored = (np.load(tmp_path / f"{name}.npz") for name in ("single", "multi", "restored"))
    assert sorted(single.files) == sorted(multi.files)
    assert {"starpo/actor/grad_norm", "starpo/critic/vf_loss", "tdd/1/loss"} <= set(single.files)
    assert single["starpo/actor/grad_norm"] > 0 and single["tdd/0/loss"] != single["tdd/1/loss"]
    for name in single.files:
        np.testing.assert_allclose(multi[name], single[name], rtol=1e-5, atol=1e-6, err_msg=name)
    params = [name for name in multi.files if name.startswith("params")]
    assert sorted(restored.files) == sorted(params) and any("tdd" in name for name in params)
    for name in params:
        np.testing.assert_array_equal(restored[name], multi[name], err_msg=name)


def test_launch_scripts_join_a_multi_process_launch_from_the_environment():
    """Importing a launch script starts ``jax.distributed`` before gymnax (imported by envs) starts the backend."""
    port = free_port()
    script = "import launch.starpo, launch.evaluate, launch.tdd, jax; print('processes', jax.process_count())"
    outputs = run_processes([([sys.executable, "-c", script], dict(
        worker_env(1), JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)))
        for i in range(2)], timeout=120)
    assert all("processes 2" in output for output in outputs), outputs
