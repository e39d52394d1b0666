"""Benchmark hygiene shared by every ``bench/`` script: equal threads, load average, interleaved best-of timings.

    hygiene.add_threads_argument(parser)
    args = parser.parse_args()
    hygiene.start(args.threads)  # before the first JAX computation
    ...  # build, compile, time, print the table; the end report follows when the script exits

``start`` pins the process to ``threads`` cores before the XLA CPU client starts (XLA sizes its thread
pool from the cores the process may use, and all its threads run on those cores), gives PyTorch the same
number of threads, and prints the thread count and the load average at the start and the end. When the
1-minute load was above ``BUSY_LOAD_PER_CORE`` × cores at the start, or at the end once the benchmark's own
threads are subtracted, it prints a warning under the table:
the figures come from a busy machine and must not be recorded as idle numbers (in-process ratios still
compare like with like).
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import time
from typing import Callable, Sequence

BUSY_LOAD_PER_CORE = 0.5


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """Adds ``--threads`` (cores for XLA and PyTorch alike; default all of them)."""
    parser.add_argument("--threads", "--torch-threads", dest="threads", type=int, default=os.cpu_count(),
                        help="cores used by both sides: XLA's thread pool and torch.set_num_threads (default all)")


def set_threads(threads: int) -> int:
    """Restricts this process to ``threads`` cores and PyTorch (if imported) to as many threads.

    Must run before JAX creates its CPU client (the first ``jax.devices()`` or computation).
    """
    cores = sorted(os.sched_getaffinity(0))
    if not 1 <= threads <= len(cores):
        raise ValueError(f"--threads {threads}: this process may use 1 to {len(cores)} cores")
    os.sched_setaffinity(0, cores[:threads])
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # read by torch when imported later
        os.environ[name] = str(threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
    return threads


def load_line(when: str) -> tuple[str, float]:
    """``"load average at <when>: 1 / 5 / 15 min"`` and the 1-minute value."""
    one, five, fifteen = os.getloadavg()
    return f"load average at {when}: {one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min)", one


def busy(load: float, cores: int | None = None) -> bool:
    """Whether a 1-minute load average means another job shared the machine."""
    return load > BUSY_LOAD_PER_CORE * (cores or os.cpu_count())


def start(threads: int) -> int:
    """Sets equal threads, prints them and the load; at exit prints the load again and warns if the machine was busy."""
    set_threads(threads)
    line, first = load_line("start")
    print(f"threads: {threads} for XLA (process affinity) and for torch; {os.cpu_count()} cores; {line}", flush=True)
    atexit.register(_finish, first, threads)
    return threads


def _finish(first: float, threads: int) -> None:
    """The end report; the end load counts this benchmark's own ``threads`` busy threads, so they are subtracted."""
    line, last = load_line("end")
    print(line)
    if busy(first) or busy(last - threads):
        print(f"WARNING: machine busy (1-min load {first:.2f} at start, {last:.2f} at end > "
              f"{BUSY_LOAD_PER_CORE} x {os.cpu_count()} cores): do not record these figures as idle numbers; "
              "only in-process ratios compare like with like. Re-run on an idle machine.", flush=True)


def best_of(fns: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    """Fastest of ``repeats`` wall-clock times of each function, called in turns (warm them up first)."""
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best
