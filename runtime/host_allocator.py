"""Host memory: glibc's malloc set to keep freed memory for reuse, so XLA:CPU does not fault it in anew.

XLA:CPU allocates each execution's temporaries with ``malloc`` from its worker threads. glibc gives a
thread other than the main one its own arena, whose heaps hold at most 64 MiB, so a larger request is
served by ``mmap`` and unmapped on ``free``: every execution of a program with large temporaries then
page-faults them in again, zero-filled by the kernel. On the demo's SFT (200 steps of the 2-layer policy,
2-core host) that was 7.0 M minor page faults and 17 s of system time; with ``keep_freed_memory`` 0.4 M and
6.5 s, and the median step at the shortest width 109-122 ms instead of 150-162 ms (``bench/README.md``).

The settings (``mallopt``): one arena for every thread (``M_ARENA_MAX``; the main arena grows without a
heap limit), no ``mmap`` for large blocks (``M_MMAP_MAX`` 0) and freed memory at the top of the heap kept up
to 2 GiB (``M_TRIM_THRESHOLD``). Freed blocks are reused instead of returned to the system, so the
resident size stays near its peak. The arena limit counts only while no thread has made an arena, hence
``launch/__init__.py`` calls this before anything starts a thread, for the scripts in ``SCRIPTS`` and only
when JAX will run on the CPU (``runs_on_cpu``): one
arena serialises threads that allocate often, and the TDD demo's convolution threads do (its fast preset took
143 s instead of 113 s, with 1.7 M futex calls instead of 0.14 M).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from typing import Sequence

# ``python -m`` modules that set it: the StarPO trainer and its demo (the main job: 8 min 42 s instead of 9:39).
SCRIPTS = ("launch.starpo",)
# Packages through which JAX finds an accelerator; with one installed (and ``JAX_PLATFORMS`` not ``cpu``) the
# programs do not run on XLA:CPU and the setting is left out.
ACCELERATOR_PLUGINS = ("libtpu", "jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin")

# mallopt parameters of glibc's <malloc.h>
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
TRIM_THRESHOLD_BYTES = 2**31 - 1
# Variables through which a user sets glibc's malloc; when any is set, theirs stand.
USER_SETTINGS = ("GLIBC_TUNABLES", "MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_",
                 "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "LD_PRELOAD")


def keep_freed_memory() -> bool:
    """Sets glibc's malloc as the module docstring says; returns whether it did.

    Does nothing (returns ``False``) on a C library other than glibc, or when the environment sets malloc
    itself (``USER_SETTINGS``: glibc tunables or ``MALLOC_*`` variables, or a preloaded allocator).
    """
    if any(name in os.environ for name in USER_SETTINGS) or not _is_glibc():
        return False
    libc = ctypes.CDLL(None)
    settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    return all(libc.mallopt(parameter, value) == 1 for parameter, value in settings)


def _is_glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (AttributeError, ValueError, OSError):
        return False


def runs_on_cpu() -> bool:
    """Whether JAX will run on the CPU: ``JAX_PLATFORMS=cpu``, or no accelerator plugin installed."""
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return True
    return not any(importlib.util.find_spec(name) is not None for name in ACCELERATOR_PLUGINS)


def launched_module(argv: Sequence[str] | None = None) -> str | None:
    """The module a ``python [options] -m MODULE …`` command line (default: this interpreter's) runs, else None."""
    argv = list(sys.orig_argv if argv is None else argv)
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            return argv[i + 1] if i + 1 < len(argv) else None
        if arg.startswith("-m"):
            return arg[2:]
        if arg == "-c" or not arg.startswith("-"):  # a command or a script: no module
            return None
        i += 2 if arg in ("-X", "-W") else 1  # the options that take the next argument
    return None
