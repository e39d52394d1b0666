"""One terminal for the launch scripts: progress bars, log records and warnings share a rich console.

A record logged while a bar is live is printed above the bar instead of onto its line. ``setup_terminal``
also turns off ``transformers``' advisory notices (e.g. "PyTorch was not found. Models won't be
available…"), which only say that its PyTorch models are unavailable: this project runs its own JAX models
and reads only tokenizers, configs and weight files through ``transformers``. It must run before
``transformers`` is first imported; ``launch/__init__.py`` calls it.
"""

from __future__ import annotations

import logging
import os
import sys

from rich.console import Console
from rich.logging import RichHandler

CONSOLE = Console(stderr=True)


def setup_terminal(level: int = logging.WARNING) -> None:
    """Routes the root logger and ``warnings.warn`` through ``CONSOLE``; silences advisory banners.

    On a terminal records go through rich (above the live bars); otherwise (a SLURM log, a pipe) each record
    is one plain, unwrapped line on stderr, so log files can be searched for it.
    """
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    root = logging.getLogger()
    if not any(getattr(handler, "setup_terminal", False) for handler in root.handlers):
        if CONSOLE.is_terminal:
            handler = RichHandler(console=CONSOLE, show_path=False, log_time_format="[%X]")
        else:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("[%(asctime)s] %(levelname)s %(message)s", "%H:%M:%S"))
        handler.setup_terminal = True
        root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)
