"""The launch scripts' terminal: log records and warnings on the progress bars' console, no advisory banner."""

import io
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

from rich.console import Console
from rich.logging import RichHandler

from runtime import console as terminal

REPO = Path(__file__).resolve().parents[1]


def route_through(console, monkeypatch) -> list[logging.Handler]:
    """Runs ``setup_terminal`` (twice: idempotent) with ``console`` as the shared console; logs a record and a
    warning; returns the handlers it added."""
    monkeypatch.setattr(terminal, "CONSOLE", console)
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [h for h in root.handlers if not getattr(h, "setup_terminal", False)])
    monkeypatch.setattr(root, "level", root.level)
    logging.captureWarnings(False)  # another test in this process may have captured them already
    terminal.setup_terminal()
    terminal.setup_terminal()
    try:
        logging.warning("Echo Trap: in-group reward std fell " + "x" * 120)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("a library warning")
    finally:
        logging.captureWarnings(False)
    return [h for h in root.handlers if getattr(h, "setup_terminal", False)]


def test_records_and_warnings_go_through_the_shared_console(monkeypatch):
    shared = Console(file=io.StringIO(), width=100, force_terminal=True)
    added = route_through(shared, monkeypatch)
    assert len(added) == 1 and isinstance(added[0], RichHandler)
    text = shared.file.getvalue()
    assert "Echo Trap: in-group reward std fell" in text and "a library warning" in text


def test_without_a_terminal_each_record_is_one_unwrapped_line(monkeypatch, capsys):
    """A log file (SLURM, a pipe) gets plain lines: a long message stays on one line, searchable."""
    added = route_through(Console(file=io.StringIO(), width=40, force_terminal=False), monkeypatch)
    assert len(added) == 1 and not isinstance(added[0], RichHandler)
    lines = capsys.readouterr().err.splitlines()
    assert any(line.endswith("WARNING Echo Trap: in-group reward std fell " + "x" * 120) for line in lines)
    assert any("UserWarning: a library warning" in line for line in lines)


def test_launch_package_silences_transformers_advisory_notices():
    """The "PyTorch was not found" banner is such a notice; this venv has torch, so a probe notice stands in."""
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    probe = ("import transformers.utils.logging as l; l.get_logger('transformers.probe').warning_advice('ADVICE'); "
             "l.get_logger('transformers.probe').warning('REAL')")
    run = lambda code: subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    quiet, loud = run("import launch; " + probe), run(probe)
    assert quiet.returncode == 0 and loud.returncode == 0, quiet.stderr + loud.stderr
    assert "ADVICE" in loud.stderr and "ADVICE" not in quiet.stderr
    assert "REAL" in quiet.stderr  # real warnings still show
