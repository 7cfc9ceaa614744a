"""The worker's training thread (`baton.workers.actor.Steps`): steps run one at a time, in the
order they were handed over, off the caller's thread; their results and errors come back to
whoever asks; a world that ends fails every wait on it instead of leaving it waiting."""

import threading
import time

import pytest

from baton.workers.actor import Steps


def test_steps_run_in_order_on_one_thread_of_their_own():
    steps, ran = Steps(), []
    gate = threading.Event()

    def step(k):
        def run():
            gate.wait(5)  # the first holds the thread while the rest are handed over
            ran.append((k, threading.current_thread().name))
            return {"step": k}
        return run

    steps.join("w")
    for k in range(5):
        steps.put("w", k, step(k))  # returns at once: the caller is free for the next call
    assert ran == []
    gate.set()
    assert [steps.result("w", k)["step"] for k in reversed(range(5))] == [4, 3, 2, 1, 0]
    assert [k for k, _ in ran] == [0, 1, 2, 3, 4]
    assert {name for _, name in ran} == {"baton-steps"}


def test_a_step_s_error_is_raised_by_its_result_and_the_next_step_still_runs():
    steps = Steps()
    steps.join("w")

    def fail():
        raise ValueError("bad batch")

    steps.put("w", 0, fail)
    steps.put("w", 1, lambda: "ok")
    with pytest.raises(ValueError, match="bad batch"):
        steps.result("w", 0)
    assert steps.result("w", 1) == "ok"


def test_a_call_runs_on_the_training_thread_after_the_steps_handed_over_before_it():
    """A checkpoint queued behind step k sees the state after step k, and runs on the thread
    the steps run on (torch keeps some state per thread)."""
    steps, done = Steps(), []
    steps.join("w")
    for k in range(3):
        steps.put("w", k, lambda k=k: (time.sleep(0.05), done.append(k)))
    assert steps.call(lambda: (list(done), threading.current_thread().name)) == ([0, 1, 2], "baton-steps")
    with pytest.raises(KeyError):
        steps.call(lambda: {}["missing"])


def test_ending_a_world_drops_its_queued_steps_and_fails_every_wait_on_it():
    steps, ran = Steps(), []
    started, release = threading.Event(), threading.Event()

    def slow():
        started.set()
        release.wait(5)
        ran.append(0)
        return "done"

    steps.join("old")
    steps.put("old", 0, slow)
    steps.put("old", 1, lambda: ran.append(1))  # handed over, never started: dropped by `end`
    started.wait(5)
    errors = []

    def wait(step):  # a result asked for a step whose hand-over was cancelled (step 2)
        try:
            steps.result("old", step)
        except RuntimeError as e:
            errors.append((step, str(e)))

    waiters = [threading.Thread(target=wait, args=(k,)) for k in (1, 2)]
    for w in waiters:
        w.start()
    time.sleep(0.05)
    steps.end()  # as `leave` does, then its own call: after the step still running
    leaver = threading.Thread(target=lambda: ran.append(steps.call(lambda: "left")))
    leaver.start()
    for w in waiters:
        w.join(5)
    time.sleep(0.1)
    assert ran == []  # the running step goes on, and the call waits for it
    release.set()
    leaver.join(5)
    assert ran == [0, "left"]
    assert sorted(errors) == [(1, "step 2 was not run: world old ended"),
                              (2, "step 3 was not run: world old ended")]
    with pytest.raises(RuntimeError, match="world old ended"):  # a late hand-over of it
        steps.put("old", 3, lambda: ran.append(3)) or steps.result("old", 3)
    assert ran == [0, "left"]


def test_a_result_asked_before_its_world_is_joined_waits_for_its_step():
    """The results come back on threads of their own, so one may be asked before the call that
    joins its world (on the default thread) has run; it waits, and gets the new world's step."""
    steps = Steps()
    got = []
    asker = threading.Thread(target=lambda: got.append(steps.result("new", 0)))
    asker.start()
    time.sleep(0.05)
    steps.join("new")
    steps.put("new", 0, lambda: "first step")
    asker.join(5)
    assert got == ["first step"]


def test_ending_one_world_leaves_the_next_one_s_steps():
    """A recovery ends the world it gives up, by name, beside the calls in flight; a step of
    the next world, handed over already, still runs."""
    steps = Steps()
    steps.join("old")
    steps.join("new")
    steps.put("new", 0, lambda: "new world's step")
    steps.end("old")
    with pytest.raises(RuntimeError, match="world old ended"):
        steps.result("old", 6)
    assert steps.result("new", 0) == "new world's step"


def test_a_failed_step_s_error_holds_none_of_its_frames_variables():
    """A failed step's error may outlive `leave` (it did, once handed to Ray); the variables of
    its frames (the world's modules and process groups) must not, or a peer in a collective
    with this rank waits out the timeout instead of failing when this rank leaves. Its
    traceback's lines stay, for the message."""
    import traceback
    import weakref

    class Group:
        pass

    steps, refs = Steps(), []

    def step():
        group = Group()
        refs.append(weakref.ref(group))
        raise RuntimeError("peer gone")

    steps.join("w")
    steps.put("w", 0, step)
    with pytest.raises(RuntimeError) as raised:
        steps.result("w", 0)
    assert refs[0]() is None  # while the error is still held
    assert "in step" in "".join(traceback.format_tb(raised.value.__traceback__))
