"""bench/hygiene.py: the busy threshold, thread-count errors, interleaved best-of timings."""

import os

import pytest

from bench import hygiene


def test_busy_threshold():
    assert not hygiene.busy(1.0, cores=2)
    assert hygiene.busy(1.01, cores=2)


def test_set_threads_rejects_more_cores_than_allowed():
    with pytest.raises(ValueError, match="--threads 0"):
        hygiene.set_threads(0)
    with pytest.raises(ValueError, match="--threads"):
        hygiene.set_threads(len(os.sched_getaffinity(0)) + 1)


def test_best_of_calls_in_turns_and_keeps_the_fastest():
    calls = []
    best = hygiene.best_of([lambda: calls.append("a"), lambda: calls.append("b")], 3)
    assert calls == ["a", "b"] * 3
    assert len(best) == 2 and all(0 <= t < 1 for t in best)


@pytest.mark.parametrize("first, last, threads, warned", [(0.3, 2.4, 2, False), (0.3, 2.4, 1, True),
                                                          (1.5, 0.5, 1, True)])
def test_end_report_discounts_the_benchmarks_own_threads(monkeypatch, capsys, first, last, threads, warned):
    monkeypatch.setattr(hygiene, "load_line", lambda when: (f"load at {when}", last))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    hygiene._finish(first, threads)
    assert ("WARNING: machine busy" in capsys.readouterr().out) == warned
