"""SIGTERM sets the stop flag instead of killing the process; handlers are restored."""

import os
import signal

from runtime.preemption import PreemptionHandler


def test_sigterm_requests_a_stop_and_handler_is_restored():
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionHandler() as preemption:
        assert not preemption.requested()
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.requested()
    assert signal.getsignal(signal.SIGTERM) is before
