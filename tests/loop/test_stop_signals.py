"""The training loop's stop signals leave alone a signal the process was started ignoring."""
from __future__ import annotations

import os
import signal

from ipu_unit_scaling.loop.stop_signals import StopRequest


def test_a_signal_started_ignored_stays_ignored_and_the_other_is_handled():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopRequest() as stop:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.signum is None
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.signum == signal.SIGTERM
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_handled_signal_asks_to_stop_and_its_handler_comes_back():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with StopRequest() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.signum == signal.SIGINT
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
