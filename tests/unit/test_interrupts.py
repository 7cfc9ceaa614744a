"""Ctrl-C and SIGTERM wait for a write to the run's record to finish (baton.interrupts).

A SIGTERM that landed inside MLflow's sqlite write once left the store locked, and the run
could not be marked KILLED (a CI failure of
test_interrupted_run_is_marked_killed_and_keeps_its_checkpoint[SIGTERM])."""

from __future__ import annotations

import os
import signal
import time

import pytest

from baton import interrupts


@pytest.fixture
def handlers():
    previous = interrupts.install()
    yield
    interrupts.restore(previous)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_inside_a_shielded_write_is_raised_when_it_ends(handlers, signum):
    finished = []
    with pytest.raises(KeyboardInterrupt) as e:
        with interrupts.shielded():
            os.kill(os.getpid(), signum)
            time.sleep(0.05)  # the handler runs here, and holds the interrupt
            finished.append("the write")
        finished.append("after the block")
    assert finished == ["the write"] and e.value.args == (signum,)


def test_a_signal_outside_is_raised_at_once_and_nested_blocks_wait_for_the_outermost(handlers):
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        raise AssertionError("not interrupted")
    order = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts.shielded():
            with interrupts.shielded():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
            order.append("inner ended, outer still writing")
    assert order == ["inner ended, outer still writing"]


def test_the_signal_is_named_when_ray_drops_it(handlers):
    """`ray.get` and `ray.wait` turn the handler's KeyboardInterrupt(SIGTERM) into a bare
    KeyboardInterrupt() (checked with Ray 2.60: a SIGTERM sent while the driver waited on a
    sleeping task came out with no args); the CLI must still report SIGTERM and exit 143, not
    SIGINT and 130 (a CI failure of test_interrupted_run_is_marked_killed_and_keeps_its_checkpoint)."""
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
    assert interrupts.received(KeyboardInterrupt()) == signal.SIGTERM
    assert interrupts.received(KeyboardInterrupt(signal.SIGINT)) == signal.SIGINT
    interrupts.install()  # a new run forgets the last one's signal: Python's own Ctrl-C is SIGINT
    assert interrupts.received(KeyboardInterrupt()) == signal.SIGINT
