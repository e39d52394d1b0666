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

from rich.console import Console
from rich.logging import RichHandler

CONSOLE = Console(stderr=True)


def setup_terminal(level: int = logging.WARNING) -> None:
    """Routes the root logger and ``warnings.warn`` through ``CONSOLE``; silences advisory banners."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    root = logging.getLogger()
    if not any(isinstance(handler, RichHandler) for handler in root.handlers):
        root.addHandler(RichHandler(console=CONSOLE, show_path=False, log_time_format="[%X]"))
    root.setLevel(level)
    logging.captureWarnings(True)
