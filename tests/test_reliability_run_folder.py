"""Both trainers keep their run folder safe: a corrupt newest checkpoint is moved aside and the run finishes,
a changed config is refused with a diff (or allowed by name and recorded), one writer at a time, SIGTERM
exits with code 75 after saving, validation off with ``test_freq <= 0``, bad paths refused before loading,
and read-only commands create nothing."""

import json
import os
import shutil
import signal
import socket
import threading
import time

import pytest

from launch import evaluate, starpo, tdd
from runtime.metrics import read_jsonl
from runtime.preemption import PREEMPTED_EXIT_CODE, Preempted
from runtime.run_folder import RunFolderError, RunLock
from test_launch_starpo import checkpoint, run  # noqa: F401  (the tiny local Hugging Face checkpoint fixture)
from test_launch_tdd import first_run, images  # noqa: F401  (a finished 4-step tiny distillation)
from test_tdd_models_io import pipeline_dir  # noqa: F401  (a tiny diffusers folder)


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
    assert read_jsonl(out / "config_changes.jsonl") == [{"step": 1, "changed": {"trainer.total_training_steps": [2, 3]}}]

    other_model = tmp_path / "same_shapes"
    shutil.copytree(checkpoint, other_model)
    for extra, change in [(("actor_rollout_ref.actor.optim.lr=1e-3",), "actor_rollout_ref.actor.optim.lr: 1e-06 -> 0.001"),
                          ((f"model_path={other_model}",), f"model_path: '{checkpoint}' -> '{other_model}'")]:
        with pytest.raises(RunFolderError, match=f"changed keys:\n  {change}\n"):
            train(other_model if "model_path" in extra[0] else checkpoint, out, 3, *extra)
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


def distil_args(pipeline_dir, images, out, *extra):  # noqa: F811
    return ["distil", "--preset", "tiny", f"teacher={pipeline_dir}", f"data={images}", f"out={out}", *extra]


def test_tdd_run_folder_refuses_mixed_runs_and_bad_paths(first_run, pipeline_dir, images, tmp_path):  # noqa: F811
    reference, _ = first_run
    record = (reference / "config.json").read_text()
    with pytest.raises(RunFolderError, match=r"changed keys:\n  distill.learning_rate: 0.001 -> 0.01\n"):
        tdd.main(distil_args(pipeline_dir, images, reference, "distill.learning_rate=1e-2"))
    assert (reference / "config.json").read_text() == record and "out" not in json.loads(record)
    (tmp_path / "nodata").mkdir()
    with pytest.raises(ValueError, match=r"data: folder .*nodata' holds no images \(.jpg, .jpeg, .png, .webp\) and "
                                         r"no .tar shards"):
        tdd.main(["distil", "--preset", "tiny", f"teacher={pipeline_dir}", f"data={tmp_path / 'nodata'}",
                  f"out={tmp_path / 'o'}"])
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"output folder: .*file is a file"):
        tdd.main(distil_args(pipeline_dir, images, tmp_path / "file"))
    (tmp_path / "no_ckpt").mkdir()
    shutil.copy(reference / "config.json", tmp_path / "no_ckpt")
    with pytest.raises(FileNotFoundError, match=r"no checkpoint folder .*no_ckpt/checkpoints"):
        tdd.main(["export", f"run={tmp_path / 'no_ckpt'}"])
    with pytest.raises(ValueError, match=r"out: .* is a folder, not a file"):
        tdd.main(["export", f"run={reference}", f"out={tmp_path}"])
    assert sorted(os.listdir(tmp_path)) == ["file", "no_ckpt", "nodata"]
    assert os.listdir(tmp_path / "no_ckpt") == ["config.json"]


def signal_after_row(path, step):
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if path.is_file() and any(r["step"] >= step for r in read_jsonl(path)):
            os.kill(os.getpid(), signal.SIGTERM)
            return
        time.sleep(0.005)


def test_tdd_corrupt_checkpoint_then_sigterm_then_finish(first_run, pipeline_dir, images, tmp_path,  # noqa: F811
                                                         caplog):
    """``first_run`` (checkpoints 3, 4) with checkpoint 4 missing its state, extended to 8 steps: falls back to 3,
    retrains step 4 exactly, stops on SIGTERM with code 75 after saving, and a rerun finishes."""
    reference, _ = first_run
    folder = tmp_path / "run"
    shutil.copytree(reference, folder, ignore=shutil.ignore_patterns("lora.safetensors", ".lock"))
    shutil.rmtree(folder / "checkpoints" / "4" / "state")
    argv = distil_args(pipeline_dir, images, folder, "max_train_steps=8", "--allow-change", "max_train_steps")
    sender = threading.Thread(target=signal_after_row, args=(folder / "metrics.jsonl", 5))
    sender.start()
    with pytest.raises(Preempted) as stopped:
        tdd.main(argv)
    sender.join()
    assert stopped.value.code == PREEMPTED_EXIT_CODE
    rows = read_jsonl(folder / "metrics.jsonl")
    saved = rows[-1]["step"]
    assert 5 <= saved <= 8 and [r["step"] for r in rows] == list(range(1, saved + 1))
    assert f"SIGTERM: saved checkpoint {saved} in {folder / 'checkpoints'}; exiting with code 75" in caplog.text
    assert rows[:4] == read_jsonl(reference / "metrics.jsonl")  # step 4 retrained from checkpoint 3, exactly
    assert (folder / "checkpoints.unreadable" / "4").is_dir() and not (folder / "lora.safetensors").exists()
    tdd.main(argv)
    assert [r["step"] for r in read_jsonl(folder / "metrics.jsonl")] == list(range(1, 9))
    assert (folder / "lora.safetensors").is_file()
