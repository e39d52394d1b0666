"""Multi-host start-up: launch detection, and a two-process loopback run equal to one process."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from runtime.distributed import DistributedConfig, resolve

WORKER = os.path.join(os.path.dirname(__file__), "distributed_worker.py")


@pytest.mark.parametrize("environ", [
    {},
    {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"},
    {"TPU_WORKER_HOSTNAMES": "host0"},
    {"JAX_NUM_PROCESSES": "1"},
])
def test_single_process_launch_is_a_no_op(environ):
    assert resolve(DistributedConfig(), environ) is None


@pytest.mark.parametrize("environ", [
    {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"},
    {"TPU_WORKER_HOSTNAMES": "host0,host1,host2,host3"},
    {"OMPI_COMM_WORLD_SIZE": "2"},
])
def test_cluster_launch_is_detected(environ):
    assert resolve(DistributedConfig(), environ) == DistributedConfig()


def test_environment_variables_fill_unset_fields():
    environ = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    assert resolve(DistributedConfig(), environ) == DistributedConfig("10.0.0.1:1234", 2, 1)
    assert resolve(DistributedConfig(process_id=0), environ).process_id == 0


@pytest.mark.parametrize("config, environ, message", [
    (DistributedConfig(num_processes=2), {}, "coordinator_address and distributed.process_id"),
    (DistributedConfig("h:1", 2, 2), {}, "process_id=2 is outside"),
    (DistributedConfig(num_processes=0), {}, "num_processes must be >= 1"),
    (DistributedConfig(), {"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES must be an integer"),
])
def test_bad_settings_name_the_field(config, environ, message):
    with pytest.raises(ValueError, match=message):
        resolve(config, environ)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(num_processes: int, devices_per_process: int, out: str) -> None:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}")
    port = free_port()
    run_processes([([sys.executable, WORKER, str(i), str(num_processes), str(port), out], env)
                   for i in range(num_processes)], timeout=180)


def run_processes(commands: list[tuple[list[str], dict[str, str]]], timeout: float) -> list[str]:
    """Starts every ``(argv, environment)`` at once, waits for all, asserts each exited 0; their outputs."""
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for argv, env in commands]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, output in zip(procs, outputs):
        assert p.returncode == 0, output[-3000:]
    return outputs


def test_two_processes_on_loopback_equal_one_process(tmp_path):
    run_workers(1, 4, str(tmp_path / "single.json"))
    run_workers(2, 2, str(tmp_path / "multi.json"))
    single = json.loads((tmp_path / "single.json").read_text())
    multi = json.loads((tmp_path / "multi.json").read_text())
    x_all = np.random.default_rng(0).normal(size=(8, 16)).astype(np.float32)
    np.testing.assert_allclose(single["sum_sq"], (x_all.astype(np.float64) ** 2).sum(), rtol=1e-5)
    np.testing.assert_allclose(multi["sum_sq"], single["sum_sq"], rtol=1e-6)
    np.testing.assert_allclose(multi["loss"], single["loss"], rtol=1e-6)
    assert multi["grads"].keys() == single["grads"].keys()
    for name in single["grads"]:
        np.testing.assert_allclose(multi["grads"][name], single["grads"][name], atol=1e-6, err_msg=name)
