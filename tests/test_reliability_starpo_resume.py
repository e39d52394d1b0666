"""The StarPO trainer (``python -m launch.starpo``) survives SIGTERM (exit code 75) and SIGKILL bit for bit,
and stops on repeated non-finite updates after saving; an interrupted checkpoint write is never taken as
the latest; a resumed run rewrites the metric rows after its checkpoint."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from runtime.checkpoint import Checkpointer
from runtime.guards import NonFiniteError, NonFiniteGuard
from runtime.mesh import MeshConfig, make_mesh
from runtime.metrics import MetricWriter, read_jsonl
from runtime.preemption import PREEMPTED_EXIT_CODE
from runtime.sharding import create_sharded
from runtime.train_state import init_train_state
from runtime_fixtures import TinyMLP
from starpo_jax.echo_trap import EchoTrapMonitor
from test_launch_starpo import checkpoint  # noqa: F401  (the tiny local Hugging Face checkpoint fixture)
from test_reliability_multiprocess import worker_env

STEPS = 5
TIMEOUT = 400


def trainer_command(model: Path, out: Path, *overrides: str) -> list[str]:
    """A one-device tiny run: 2 groups × 4 Bandit rollouts of one turn, half kept, one mini-batch per iteration."""
    return [sys.executable, "-m", "launch.starpo", "--preset", "tiny", "--out", str(out), "--mesh", "1,1,1",
            f"model_path={model}", "es_manager.train.env_configs.tags=[Bandit]", "es_manager.train.env_groups=2",
            "es_manager.train.env_configs.n_groups=[2]", "es_manager.val.env_configs.tags=[BanditTest]",
            "ppo_mini_batch_size=4", "micro_batch_size_per_gpu=4", "agent_proxy.max_turn=1",
            "actor_rollout_ref.rollout.response_length=8", "actor_rollout_ref.rollout.max_model_len=1024",
            f"trainer.total_training_steps={STEPS}", "trainer.val_before_train=False", "trainer.test_freq=0",
            *overrides]


def start(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(command, env=worker_env(1), cwd=Path(__file__).parents[1], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        output = proc.communicate(timeout=TIMEOUT)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, output


def wait_for_checkpoint(proc: subprocess.Popen, folder: Path, step: int) -> None:
    """Polls until checkpoint ``step`` is complete (orbax renames its temporary folder when done)."""
    deadline = time.monotonic() + TIMEOUT
    while not (folder / "checkpoints" / str(step)).is_dir():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) before checkpoint {step}:\n"
                                 + proc.stdout.read()[-3000:])
        assert time.monotonic() < deadline, f"no checkpoint {step} after {TIMEOUT} s"
        time.sleep(0.2)


def checkpoint_arrays(folder: Path) -> dict[str, np.ndarray]:
    """Every array of a saved train state (parameters, optimizer state, step, RNG key data), by key path."""
    path = folder / "state"
    metadata = ocp.PyTreeCheckpointer().metadata(path)
    tree = getattr(metadata, "item_metadata", metadata)
    tree = getattr(tree, "tree", tree)
    restored = ocp.PyTreeCheckpointer().restore(
        path, restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree))
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(restored)[0]}


def metric_rows(folder: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("timing_s/")} for row in
            read_jsonl(folder / "metrics.jsonl")]


def interrupted_run(model: Path, out: Path, rng: random.Random, log: list[str]) -> None:
    """SIGTERM after checkpoint 1 or 2, SIGKILL after a random later checkpoint, then a run to the end."""
    proc = start(trainer_command(model, out, "trainer.save_freq=1"))
    term_after = rng.choice([1, 2])
    wait_for_checkpoint(proc, out, term_after)
    proc.send_signal(signal.SIGTERM)
    rc, output = finish(proc)
    assert rc == PREEMPTED_EXIT_CODE, output[-3000:]
    stopped = max(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert f"SIGTERM: saved checkpoint {stopped} in {out / 'checkpoints'}; exiting with code 75" in output
    # The signal arrived after the stop check of step term_after: the run saves after the next step and exits.
    assert stopped == term_after + 1 and not (out / "hf_model").exists(), (term_after, stopped)
    assert [row["step"] for row in read_jsonl(out / "metrics.jsonl")] == list(range(1, stopped + 1))
    log.append(f"SIGTERM after checkpoint {term_after} stopped at {stopped}")
    kill_after = rng.randrange(stopped + 1, STEPS)
    proc = start(trainer_command(model, out, "trainer.save_freq=1"))
    wait_for_checkpoint(proc, out, kill_after)
    time.sleep(rng.uniform(0.0, 1.0))
    proc.kill()
    finish(proc)
    log.append(f"SIGKILL after checkpoint {kill_after}")
    rc, output = finish(start(trainer_command(model, out, "trainer.save_freq=1")))
    assert rc == 0, output[-3000:]


def capture(fn, *args) -> list[BaseException]:
    try:
        fn(*args)
    except BaseException as error:  # reported by the test thread
        return [error]
    return []


@pytest.fixture(scope="module")
def nan_checkpoint(checkpoint, tmp_path_factory):  # noqa: F811
    """The tiny checkpoint with a NaN final norm: every loss and gradient is NaN."""
    folder = tmp_path_factory.mktemp("nan_model")
    for item in checkpoint.iterdir():
        if item.is_file():
            shutil.copy(item, folder / item.name)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"] = np.full_like(tensors["model.norm.weight"], np.nan)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_sigterm_then_sigkill_then_resume_equals_an_uninterrupted_run(checkpoint, nan_checkpoint,  # noqa: F811
                                                                     tmp_path):
    seed = random.randrange(2 ** 16)
    log, errors = [f"seed {seed}"], []
    chain = threading.Thread(target=lambda: errors.extend(capture(interrupted_run, checkpoint, tmp_path / "resumed",
                                                                 random.Random(seed), log)))
    chain.start()
    nan_run = start(trainer_command(nan_checkpoint, tmp_path / "nan", "trainer.max_consecutive_non_finite=2"))
    rc, output = finish(start(trainer_command(checkpoint, tmp_path / "plain", "trainer.save_freq=1")))
    assert rc == 0, output[-3000:]
    nan_rc, nan_output = finish(nan_run)
    chain.join(TIMEOUT)
    assert not chain.is_alive() and not errors, (log, errors)

    plain, resumed = tmp_path / "plain", tmp_path / "resumed"
    rows = metric_rows(plain)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1)), log
    assert metric_rows(resumed) == rows, log
    final = [checkpoint_arrays(folder / "checkpoints" / str(STEPS)) for folder in (plain, resumed)]
    assert final[0].keys() == final[1].keys() and any("rng" in key for key in final[0])
    for key, value in final[0].items():
        np.testing.assert_array_equal(final[1][key], value, err_msg=f"{key} ({log})")
    assert (resumed / "hf_model" / "model.safetensors").is_file()

    # Repeated non-finite updates: skipped and counted, then the run stops after saving the unchanged state.
    assert nan_rc != 0 and "2 consecutive steps up to step 2 had non-finite gradients" in nan_output, nan_output[-3000:]
    nan_rows = read_jsonl(tmp_path / "nan" / "metrics.jsonl")
    assert [(r["step"], r["actor/non_finite_steps"], r["actor/consecutive_non_finite"]) for r in nan_rows] == [
        (1, 1.0, 1.0), (2, 2.0, 2.0)]
    assert sorted(os.listdir(tmp_path / "nan" / "checkpoints")) == ["2"]
    saved = checkpoint_arrays(tmp_path / "nan" / "checkpoints" / "2")
    embed = load_file(nan_checkpoint / "model.safetensors")["model.embed_tokens.weight"]
    np.testing.assert_array_equal(saved["['actor']['params']['model']['embed_tokens']['value']"], embed)


def test_interrupted_write_is_never_the_latest_checkpoint(tmp_path):
    """A save killed mid-write leaves orbax's temporary folder ``<step>.orbax-checkpoint-tmp-<time>``."""
    mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    with jax.set_mesh(mesh):
        params = nnx.state(create_sharded(lambda: TinyMLP(nnx.Rngs(0)), mesh))
        states = [init_train_state(jax.tree.map(lambda x: x + i, params), optax.sgd(0.1), jax.random.key(i), mesh)
                  for i in range(3)]
        with Checkpointer(tmp_path) as ckpt:
            ckpt.save(1, states[0], {"i": 1})
            ckpt.save(2, states[1], {"i": 2})
        partial = tmp_path / "3.orbax-checkpoint-tmp-1796240000"
        shutil.copytree(tmp_path / "2", partial)
        for file in sorted(p for p in partial.rglob("*") if p.is_file())[::2]:
            file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
        with Checkpointer(tmp_path) as ckpt:
            assert ckpt.steps() == [1, 2] and ckpt.latest_step() == 2
            restored, loop, step = ckpt.restore(states[2])
    assert (step, loop) == (2, {"i": 2})
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(restored.params), nnx.to_pure_dict(states[1].params))


def test_resumed_writer_drops_rows_after_the_checkpoint(tmp_path):
    """A run killed after writing the metrics of step 3 but before checkpoint 3 writes step 3 again."""
    with MetricWriter(tmp_path, tensorboard=False, enabled=True) as writer:
        for step in range(1, 4):
            writer.write(step, {"loss": float(step)})
    with MetricWriter(tmp_path, tensorboard=False, enabled=True) as writer:
        writer.discard_after(2)
        writer.write(3, {"loss": 30.0})
    assert [(row["step"], row["loss"]) for row in read_jsonl(tmp_path / "metrics.jsonl")] == [
        (1, 1.0), (2, 2.0), (3, 30.0)]


def test_guard_watches_the_largest_of_several_counters():
    guard = NonFiniteGuard(2, keys=("actor/consecutive_non_finite", "critic/consecutive_non_finite"))
    guard.check(1, {"actor/consecutive_non_finite": 1.0, "critic/consecutive_non_finite": 0.0})
    guard.check(1, {"actor/consecutive_non_finite": 1.0})
    with pytest.raises(NonFiniteError, match="2 consecutive steps up to step 2"):
        guard.check(2, {"actor/consecutive_non_finite": 0.0, "critic/consecutive_non_finite": 2.0})


def test_echo_trap_history_survives_a_checkpoint():
    """A monitor restored from the JSON loop state warns exactly like the one that never stopped."""
    rng = np.random.default_rng(0)
    rows = [{"rollout/in_group_std": float(s), "actor/grad_norm": float(g)}
            for s, g in zip(np.r_[rng.uniform(0.3, 0.5, 8), 0.02, 0.4, 0.01], np.r_[rng.uniform(1, 2, 8), 30, 1, 40])]
    steady = EchoTrapMonitor(warmup=3)
    for step, row in enumerate(rows[:6]):
        steady.update(step, row)
    restored = EchoTrapMonitor(warmup=3)
    restored.load_state_dict(json.loads(json.dumps(steady.state_dict())))
    fresh = EchoTrapMonitor(warmup=3)
    later = list(enumerate(rows[6:], start=6))
    expected = [steady.update(step, row) for step, row in later]
    assert [restored.update(step, row) for step, row in later] == expected
    assert sum(map(len, expected)) == 4 and [fresh.update(step, row) for step, row in later] != expected
