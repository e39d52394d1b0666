"""Metric writer: JSONL rows and TensorBoard scalars read back from the event file."""

import glob
import io
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from rich.console import Console
from tensorboardX.proto import event_pb2

from runtime import metrics
from runtime.metrics import MetricWriter, ProgressBar, read_jsonl


def read_tensorboard_scalars(logdir):
    """Parses TFRecord framing (length, crc, payload, crc) of every event file in ``logdir``."""
    scalars = {}
    for path in glob.glob(f"{logdir}/events.out.tfevents.*"):
        data = open(path, "rb").read()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_scalars_go_to_jsonl_and_tensorboard(tmp_path):
    with MetricWriter(tmp_path, enabled=True) as writer:
        for step in range(3):
            got = writer.write(step, {"actor/pg_loss": jnp.float32(0.5 * step), "critic/vf_loss": np.array([step])})
            assert got == {"actor/pg_loss": 0.5 * step, "critic/vf_loss": float(step)}
        writer.write(3, {"actor/grad_norm": float("nan")})
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[2] == {"step": 2, "actor/pg_loss": 1.0, "critic/vf_loss": 2.0}
    assert rows[3] == {"step": 3, "actor/grad_norm": "nan"}
    tb = read_tensorboard_scalars(tmp_path)
    assert tb["actor/pg_loss"] == [(0, 0.0), (1, 0.5), (2, 1.0)]
    assert tb["critic/vf_loss"] == [(0, 0.0), (1, 1.0), (2, 2.0)]


def test_writer_appends_on_resume_and_rejects_non_scalars(tmp_path):
    with MetricWriter(tmp_path, tensorboard=False, enabled=True) as writer:
        writer.write(0, {"a": 1})
        with pytest.raises(ValueError, match="'b' is not a scalar"):
            writer.write(1, {"b": np.ones(3)})
    with MetricWriter(tmp_path, tensorboard=False, enabled=True) as writer:
        writer.write(1, {"a": 2})
    assert [r["a"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1.0, 2.0]


def test_disabled_writer_writes_nothing(tmp_path):
    with MetricWriter(tmp_path / "off", enabled=False) as writer:
        assert writer.write(0, {"a": 1.5}) == {"a": 1.5}
    assert not (tmp_path / "off").exists()


def test_progress_bar_shows_selected_metrics(capsys):
    with ProgressBar(4, "train", keys=("loss",)) as bar:
        bar.update(2, {"loss": 0.25, "other": 1.0})
        assert bar._progress.tasks[0].completed == 2
        assert bar._progress.tasks[0].fields["metrics"] == "loss=0.25"


def test_progress_bar_keeps_counts_and_times_at_80_columns(monkeypatch):
    console = Console(file=io.StringIO(), width=80, force_terminal=False)
    monkeypatch.setattr(metrics, "CONSOLE", console)
    with ProgressBar(200, "StarPO", keys=("train/success", "actor/pg_loss")) as bar:
        bar.update(37, {"train/success": 0.421875, "actor/pg_loss": -0.0123456})
        console.print(bar._progress.make_tasks_table(bar._progress.tasks))
    line = console.file.getvalue().splitlines()[-1]
    assert len(line) <= 80 and "37/200" in line and "-:--:--" in line
    assert "success=0.4219" in line and "pg_loss=-0.01235" not in line  # the metrics give way first
