"""The run-folder protocol on a tiny state: lock, config record and diff, history, checkpoint set-aside."""

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from runtime.checkpoint import Checkpointer
from runtime.mesh import MeshConfig, make_mesh
from runtime.metrics import MetricWriter, read_jsonl
from runtime.preemption import PREEMPTED_EXIT_CODE, Preempted, PreemptionHandler
from runtime.run_folder import RunFolder, RunFolderError, check_output, code_version, config_diff
from runtime.sharding import create_sharded
from runtime.train_state import init_train_state
from runtime_fixtures import TinyMLP

CONFIG = {"lr": 1e-6, "steps": 6, "model": {"path": "a", "layers": [2, 2]}}


@pytest.fixture(scope="module")
def states():
    mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    with jax.set_mesh(mesh):
        params = nnx.state(create_sharded(lambda: TinyMLP(nnx.Rngs(0)), mesh))
        yield [init_train_state(jax.tree.map(lambda x: x + i, params), optax.sgd(0.1), jax.random.key(i), mesh)
               for i in range(4)]


def params_of(state):
    return jax.tree.leaves(nnx.to_pure_dict(state.params))


def save_steps(folder, states, steps):
    with Checkpointer(folder / "checkpoints") as ckpt:
        for step in steps:
            ckpt.save(step, states[step], {"step": step})


def corrupt(step_folder, how):
    files = sorted(p for p in (step_folder / "state").rglob("*") if p.is_file())
    if how == "missing_state":
        shutil.rmtree(step_folder / "state")
    for file in files if how != "missing_state" else []:
        data = file.read_bytes()
        file.write_bytes({"truncated": data[: len(data) // 2], "emptied": b"",
                          "garbled": np.random.default_rng(0).bytes(len(data))}[how])


@pytest.mark.parametrize("how", ["truncated", "emptied", "garbled", "missing_state"])
def test_unreadable_newest_checkpoint_is_moved_aside_and_its_step_saved_again(tmp_path, states, how, caplog):
    save_steps(tmp_path, states, [1, 2])
    corrupt(tmp_path / "checkpoints" / "2", how)
    with Checkpointer(tmp_path / "checkpoints") as ckpt:  # a reader falls back and moves nothing
        assert ckpt.restore(states[0])[2] == 1 and ckpt.steps() == [1, 2]
    with RunFolder(tmp_path, CONFIG) as run, Checkpointer(tmp_path / "checkpoints") as ckpt, \
            caplog.at_level(logging.WARNING):
        restored, loop, start = run.resume(ckpt, states[0], total=3)
        assert (start, loop) == (1, {"step": 1}) and ckpt.steps() == [1]
        ckpt.save(2, states[3], {"step": 2})  # the step the run trains again
    for got, want in zip(params_of(restored), params_of(states[1])):
        np.testing.assert_array_equal(got, want)
    assert f"moved unreadable checkpoint step 2 to {tmp_path / 'checkpoints.unreadable' / '2'}" in caplog.text
    assert (tmp_path / "checkpoints.unreadable" / "2").is_dir()
    with Checkpointer(tmp_path / "checkpoints") as ckpt:
        assert ckpt.restore(states[0])[2] == 2


def test_config_is_recorded_and_a_changed_resume_refused_with_a_diff(tmp_path, states, caplog):
    with RunFolder(tmp_path, CONFIG) as run, Checkpointer(tmp_path / "checkpoints") as ckpt:
        run.resume(ckpt, states[0], total=6)
        ckpt.save(3, states[3], {"step": 3, **run.checkpoint_record})
    assert json.loads((tmp_path / "config.json").read_text()) == CONFIG
    assert json.loads((tmp_path / "checkpoints" / "3" / "loop" / "metadata").read_text())["config"] == CONFIG
    changed = {**CONFIG, "lr": 1e-3, "model": {"path": "b", "layers": [2, 2]}}
    with pytest.raises(RunFolderError, match=r"changed keys:\n  lr: 1e-06 -> 0.001\n  model.path: 'a' -> 'b'\n"
                                             r".*--allow-change lr,model.path"):
        RunFolder(tmp_path, changed).__enter__()
    with pytest.raises(RunFolderError, match="model.path: 'a' -> 'b'"):
        RunFolder(tmp_path, changed, allow_changes=["lr"]).__enter__()
    with pytest.raises(ValueError, match=r"--allow-change names no config key: \['lrate'\]"):
        RunFolder(tmp_path, changed, allow_changes=["lrate"])
    with RunFolder(tmp_path, changed, allow_changes=["lr", "model"]) as run, \
            Checkpointer(tmp_path / "checkpoints") as ckpt, caplog.at_level(logging.WARNING):
        assert run.resume(ckpt, states[0], total=6)[2] == 3
        with pytest.raises(RunFolderError, match="the step count 2 is below the 3 steps already done"):
            run.resume(ckpt, states[0], total=2)
    assert "with lr changed: 1e-06 -> 0.001" in caplog.text
    assert json.loads((tmp_path / "config.json").read_text()) == changed
    assert read_jsonl(tmp_path / "config_changes.jsonl") == [
        {"step": 3, "changed": {"lr": [1e-6, 1e-3], "model.path": ["a", "b"]}}]


def test_config_diff_names_added_and_removed_keys():
    assert config_diff({"a": {"b": 1, "c": (1, 2)}}, {"a": {"b": 1, "c": [1, 2], "d": None}}) == {
        "a.d": ("<absent>", None)}


def test_fresh_start_moves_an_earlier_history_aside_and_a_resume_keeps_rows_to_its_step(tmp_path, states):
    for attempt in (1, 2):
        with MetricWriter(tmp_path, enabled=True) as writer:
            writer.write(1, {"loss": float(attempt)})
        with RunFolder(tmp_path, CONFIG) as run, Checkpointer(tmp_path / "checkpoints") as ckpt:
            assert run.resume(ckpt, states[0], total=6)[2] == 0
        assert not (tmp_path / "metrics.jsonl").exists()
        assert [r["loss"] for r in read_jsonl(tmp_path / "previous" / str(attempt) / "metrics.jsonl")] == [attempt]
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "previous" / "2").iterdir())
    with MetricWriter(tmp_path, tensorboard=False, enabled=True) as writer:
        for step in (1, 2, 3):
            writer.write(step, {"loss": float(step)})
    save_steps(tmp_path, states, [2])
    with RunFolder(tmp_path, CONFIG) as run, Checkpointer(tmp_path / "checkpoints") as ckpt:
        assert run.resume(ckpt, states[0], total=6)[2] == 2
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]


HOLDER = """
import sys, time
from pathlib import Path
from runtime.run_folder import RunLock
RunLock(Path(sys.argv[1])).acquire()
print("locked", flush=True)
time.sleep(600)
"""


def test_lock_names_the_holder_and_is_released_on_exit_and_on_sigkill(tmp_path):
    with RunFolder(tmp_path, CONFIG):
        with pytest.raises(RunFolderError, match=rf"in use by another run \(host {socket.gethostname()} "
                                                 rf"pid {os.getpid()} since"):
            RunFolder(tmp_path, CONFIG).__enter__()
    with RunFolder(tmp_path, CONFIG):
        pass
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / ".lock")], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunFolderError, match=rf"pid {holder.pid} since"):
            RunFolder(tmp_path, CONFIG).__enter__()
    finally:
        holder.kill()
        holder.wait()
    with RunFolder(tmp_path, CONFIG):
        pass


def test_output_paths_are_checked(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"output folder: .*file is a file, not a folder"):
        RunFolder(tmp_path / "file", CONFIG).__enter__()
    with pytest.raises(ValueError, match=r"--out: .*file/eval.json cannot be written: .*file is a file"):
        check_output(tmp_path / "file" / "eval.json", "--out")
    with pytest.raises(ValueError, match=r"out: .* is a folder, not a file"):
        check_output(tmp_path, "out")
    check_output(tmp_path / "new" / "eval.json", "--out")
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_code_version_is_the_checkout_commit():
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert code_version().split("+")[0] == head


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_is_named_and_exits_with_the_preemption_code(sig, caplog):
    with PreemptionHandler() as preemption, caplog.at_level(logging.WARNING):
        os.kill(os.getpid(), sig)
        time.sleep(0.01)
        assert preemption.requested()
        with pytest.raises(Preempted) as stopped:
            raise preemption.stop("saved checkpoint 3 in /runs/x/checkpoints")
    assert stopped.value.code == PREEMPTED_EXIT_CODE == 75
    assert f"{sig.name}: saved checkpoint 3 in /runs/x/checkpoints; exiting with code 75" in caplog.text


def test_a_second_sigint_interrupts_at_once():
    with PreemptionHandler() as preemption:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
        assert preemption.received == "SIGINT"
