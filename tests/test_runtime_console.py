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


def test_records_and_warnings_go_through_the_shared_console(monkeypatch):
    shared = Console(file=io.StringIO(), width=100, force_terminal=False)
    monkeypatch.setattr(terminal, "CONSOLE", shared)
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [h for h in root.handlers if not isinstance(h, RichHandler)])
    monkeypatch.setattr(root, "level", root.level)
    terminal.setup_terminal()
    terminal.setup_terminal()  # idempotent: one handler
    try:
        assert sum(isinstance(h, RichHandler) for h in root.handlers) == 1
        logging.warning("Echo Trap: in-group reward std fell")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("a library warning")
    finally:
        logging.captureWarnings(False)
    text = shared.file.getvalue()
    assert "Echo Trap: in-group reward std fell" in text and "a library warning" in text


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
