"""OrderedWorkers keeps input order, reports failures, and stops at once whatever the workers do."""

import multiprocessing
import os
import re
import time

import pytest

from megatron_ul.data.ordered_workers import OrderedWorkers, WorkerError


def no_setup():
    pass


def slow_for_even(item):
    # Uneven work so that a later item finishes before an earlier one.
    time.sleep(0.05 if item % 2 == 0 else 0.0)
    return item * item


def big_result(item):
    # Far larger than a pipe's buffer: the worker is still writing it when the parent stops.
    return bytes(8 << 20)


def sleeps(item):
    time.sleep(60)


class Interrupted(Exception):
    pass


def fails_on_three(item):
    if item == 3:
        raise ValueError("bad item 3")
    return item


def dies_on_two(item):
    if item == 2:
        os._exit(7)
    return item


def fails_to_start():
    raise RuntimeError("no tokenizer here")


def test_results_come_back_in_input_order():
    workers = OrderedWorkers(2, no_setup, slow_for_even, depth=3)
    try:
        assert list(workers.imap(range(20))) == [item * item for item in range(20)]
        assert list(workers.imap(iter([]))) == []
    finally:
        workers.stop()


def test_stop_returns_while_workers_are_writing_large_results():
    before = set(multiprocessing.active_children())
    workers = OrderedWorkers(2, no_setup, big_result)
    results = workers.imap(range(1000))
    assert len(next(results)) == 8 << 20
    time.sleep(0.5)  # every worker is now blocked writing a result nobody reads
    started = time.monotonic()
    workers.stop()
    assert time.monotonic() - started < 10
    assert set(multiprocessing.active_children()) <= before


def test_interrupt_ends_the_wait_for_a_busy_worker():
    # A SIGTERM handler only sets a flag; the wait must look at it while no result comes.
    deadline = time.monotonic() + 1.0

    def interrupt():
        if time.monotonic() > deadline:
            raise Interrupted()

    workers = OrderedWorkers(1, no_setup, sleeps)
    try:
        with pytest.raises(Interrupted):
            next(workers.imap(range(3), interrupt))
        assert time.monotonic() - deadline < 10
    finally:
        workers.stop()


@pytest.mark.parametrize(
    "setup, function, message",
    [
        (no_setup, fails_on_three, "ValueError: bad item 3"),
        (no_setup, dies_on_two, "died (exit code 7)"),
        (fails_to_start, fails_on_three, "starting the worker failed"),
    ],
)
def test_a_failure_raises_worker_error_with_the_cause(setup, function, message):
    workers = OrderedWorkers(2, setup, function)
    seen = []
    try:
        with pytest.raises(WorkerError, match=re.escape(message)):
            for item in workers.imap(range(10)):
                seen.append(item)
    finally:
        workers.stop()
    expected_before_failure = [] if setup is fails_to_start else list(range(len(seen)))
    assert seen == expected_before_failure
