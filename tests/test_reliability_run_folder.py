"""The StarPO trainer keeps its run folder safe: a corrupt newest checkpoint is moved aside and the run
finishes, a changed config is refused with a diff (or allowed by name and recorded), one writer at a time,
validation off with ``test_freq <= 0``, bad paths and step counts refused before loading, and
``launch.evaluate`` creates nothing on a bad path. The TDD trainer's counterparts are in test_launch_tdd
(they share its finished distillation)."""

import json
import os
import shutil
import socket

import pytest

from launch import evaluate, starpo
from runtime.metrics import read_jsonl
from runtime.run_folder import RunFolderError, RunLock
from test_launch_starpo import checkpoint, run  # noqa: F401  (the tiny local Hugging Face checkpoint fixture)


def train(model, out, steps, *extra):
    """``test_launch_starpo``'s tiny Bandit run (the same compiled programs) with validation off (test_freq=0)."""
    return run(model, out, steps, "trainer.test_freq=0", "trainer.val_before_train=False", *extra)


def truncate_state(step_folder):
    for file in (p for p in (step_folder / "state").rglob("*") if p.is_file()):
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def loop_state(step_folder):
    return json.loads(next(p for p in (step_folder / "loop").iterdir() if p.is_file()).read_text())


def test_starpo_run_folder_survives_corruption_and_refuses_a_mixed_run(checkpoint, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    train(checkpoint, out, 2)
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and not any(k.startswith("val/") for r in rows for k in r)
    recorded = json.loads((out / "config.json").read_text())
    assert recorded["model_path"] == str(checkpoint) and recorded["trainer"]["test_freq"] == 0
    saved = loop_state(out / "checkpoints" / "2")
    assert saved["config"] == recorded and len(saved["code_version"].split("+")[0]) == 40

    truncate_state(out / "checkpoints" / "2")  # retrained from 1, saved again as 2, then 3
    train(checkpoint, out, 3, "--allow-change", "trainer.total_training_steps")
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]
    assert sorted(os.listdir(out / "checkpoints")) == ["2", "3"]
    assert (out / "checkpoints.unreadable" / "2" / "state").is_dir()
    assert read_jsonl(out / "config_changes.jsonl") == [
        {"step": 1, "changed": {"trainer.total_training_steps": [2, 3]}}]

    other_model = tmp_path / "same_shapes"
    shutil.copytree(checkpoint, other_model)
    with pytest.raises(RunFolderError, match="changed keys:\n  actor_rollout_ref.actor.optim.lr: 1e-06 -> 0.001\n"):
        train(checkpoint, out, 3, "actor_rollout_ref.actor.optim.lr=1e-3")
    with pytest.raises(RunFolderError, match=f"changed keys:\n  model_path: '{checkpoint}' -> '{other_model}'\n"):
        train(other_model, out, 3)
    with pytest.raises(RunFolderError, match=f"the step count 2 is below the 3 steps already done in {out}"):
        train(checkpoint, out, 2, "--allow-change", "trainer.total_training_steps")
    lock = RunLock(out / ".lock")
    lock.acquire()
    try:
        with pytest.raises(RunFolderError, match=rf"in use by another run \(host {socket.gethostname()} "
                                                 rf"pid {os.getpid()}"):
            train(checkpoint, out, 3)
    finally:
        lock.release()
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]


def test_starpo_and_evaluate_check_paths_and_steps_before_loading(checkpoint, tmp_path):  # noqa: F811
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"output folder: .*file is a file, not a folder"):
        train(checkpoint, tmp_path / "file", 1)
    with pytest.raises(FileNotFoundError, match=r"model_path .*empty is not a Hugging Face model folder"):
        train(tmp_path / "empty", tmp_path / "out", 1)
    with pytest.raises(ValueError, match="trainer.total_training_steps must be >= 1, got 0"):
        train(checkpoint, tmp_path / "out", 0)
    with pytest.raises(SystemExit):  # the embedded demo has no recorded config to change
        starpo.main(["--mesh", "1,-1,1", "--out", str(tmp_path / "out"), "--allow-change", "trainer.test_freq"])
    with pytest.raises(SystemExit):
        evaluate.main(["--preset", "tiny", f"model_path={checkpoint}", "--checkpoint", str(tmp_path / "typo"),
                       "--out", str(tmp_path / "eval.json")])
    with pytest.raises(ValueError, match=r"--out: .* is a folder, not a file"):
        evaluate.main(["--preset", "tiny", f"model_path={checkpoint}", "--out", str(tmp_path / "empty")])
    assert sorted(os.listdir(tmp_path)) == ["empty", "file"]
