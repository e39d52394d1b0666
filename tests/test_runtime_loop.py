"""``runtime.loop.resumable_loop``: checkpoint cadence, SIGTERM save and exit code 75, non-finite stop."""

import os
import signal

from runtime.guards import NonFiniteError, NonFiniteGuard
from runtime.loop import resumable_loop
from runtime.metrics import MetricWriter, read_jsonl
from runtime.preemption import PREEMPTED_EXIT_CODE, Preempted, PreemptionHandler


def run(tmp_path, step_fn, start=0, num_steps=5, save_every=2, checkpoints=True, max_consecutive=3):
    saved = []
    with MetricWriter(tmp_path, tensorboard=False) as writer, PreemptionHandler() as preemption:
        try:
            state, last = resumable_loop(step_fn, 0, start, num_steps,
                                         (lambda done, state: saved.append((done, state))) if checkpoints else None,
                                         writer=writer, guard=NonFiniteGuard(max_consecutive), preemption=preemption,
                                         save_every=save_every, checkpoint_dir=tmp_path)
        except BaseException as error:
            return saved, error
    return saved, (state, last)


def counting(state, i):
    return state + 1, {"numerics/consecutive_non_finite": 0, "i": i}


def test_checkpoints_every_save_every_steps_and_at_the_end_from_the_resumed_step(tmp_path):
    saved, (state, last) = run(tmp_path, counting, start=1, num_steps=5)
    assert saved == [(2, 1), (4, 3), (5, 4)] and state == 4 and last["i"] == 4
    assert [row["step"] for row in read_jsonl(tmp_path / "metrics.jsonl")] == [2, 3, 4, 5]


def test_a_stop_signal_saves_at_the_next_step_boundary_and_exits_75(tmp_path):
    def signalled(state, i):
        if i == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return counting(state, i)

    saved, error = run(tmp_path, signalled, save_every=0)
    assert isinstance(error, Preempted) and error.code == PREEMPTED_EXIT_CODE
    assert saved == [(1, 1)] and "saved checkpoint 1" in str(error)
    _, error = run(tmp_path, signalled, checkpoints=False)
    assert "checkpoints are off: nothing saved" in str(error)


def test_repeated_non_finite_steps_stop_after_saving_the_last_state(tmp_path):
    def skipping(state, i):
        return state + 1, {"numerics/consecutive_non_finite": i + 1}

    saved, error = run(tmp_path, skipping, num_steps=10, save_every=0, max_consecutive=3)
    assert isinstance(error, NonFiniteError) and saved == [(3, 3)]
