"""Worker processes that map a function over a stream in input order and can be stopped at once.

``multiprocessing.Pool`` shares locks between its workers and its helper threads; stopping it
while a worker is writing a large result can leave ``terminate()`` waiting for a lock forever (a
preempted job that never exits). Here every worker has pipes of its own and a bounded number of
items in flight, so no lock is shared between processes and stopping is a plain kill.
"""

import multiprocessing
import queue
import signal
import threading
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

POLL_SECONDS = 0.1


def _nothing() -> None:
    pass


@dataclass
class _Worker:
    process: Any
    tasks: Any  # the parent's writing end of the task pipe
    results: Any  # the parent's reading end of the result pipe
    ready: bool = False


class WorkerError(RuntimeError):
    """A worker raised, failed to start, or died."""


def _serve(tasks, results, initializer: Callable[[], None], function: Callable[[Any], Any]) -> None:
    # The parent decides when the run stops (Ctrl-C, SIGTERM) and kills the workers itself;
    # a worker whose parent died sees its pipe close and exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # A thread drains the task pipe, so the parent's send of the next item never waits on this
    # worker, which may itself be waiting for the parent to read its result.
    received: queue.Queue = queue.Queue()
    threading.Thread(target=_receive_all, args=(tasks, received), daemon=True).start()
    results.send((True, _READY))
    failure = None
    try:
        initializer()
    except Exception:
        failure = "starting the worker failed:\n" + traceback.format_exc()
    while (item := received.get()) is not _END:
        if failure is not None:
            results.send((False, failure))
            continue
        try:
            reply = (True, function(item))
        except Exception:
            reply = (False, traceback.format_exc())
        results.send(reply)


def _receive_all(tasks, received: queue.Queue) -> None:
    try:
        while True:
            received.put(tasks.recv())
    except (EOFError, OSError):
        received.put(_END)


class OrderedWorkers:
    """``imap`` over ``count`` spawned processes; results come back in the order of the items.

    Each worker holds ``depth`` items, so it starts the next while the parent reads its result.
    """

    def __init__(
        self,
        count: int,
        initializer: Callable[[], None],
        function: Callable[[Any], Any],
        depth: int = 2,
    ) -> None:
        self._depth = depth
        # Spawned, not forked: a fork taken while another thread of this process holds a lock
        # (torch, logging, a caller's threads) can leave the worker blocked forever.
        context = multiprocessing.get_context("spawn")
        self._workers = []
        for _ in range(count):
            task_reader, task_writer = context.Pipe(duplex=False)
            result_reader, result_writer = context.Pipe(duplex=False)
            process = context.Process(
                target=_serve,
                args=(task_reader, result_writer, initializer, function),
                daemon=True,
            )
            process.start()
            task_reader.close()
            result_writer.close()
            self._workers.append(_Worker(process, task_writer, result_reader))

    def imap(self, items: Iterable[Any], interrupt: Callable[[], None] = _nothing) -> Iterator[Any]:
        """``interrupt`` runs every ``POLL_SECONDS`` while waiting for a worker; what it raises
        ends the iteration (the caller then calls ``stop``)."""
        stream = iter(items)
        for index in range(len(self._workers)):
            self._await_ready(index, interrupt)
        in_flight: deque[int] = deque()  # worker indices, in the order their items were sent
        for _ in range(self._depth):
            for index in range(len(self._workers)):
                if self._send_next(index, stream):
                    in_flight.append(index)
        while in_flight:
            index = in_flight.popleft()
            result = self._receive(index, interrupt)
            if self._send_next(index, stream):
                in_flight.append(index)
            yield result

    def stop(self) -> None:
        """Kills the workers (they hold nothing worth keeping) and waits for them."""
        for worker in self._workers:
            if worker.process.is_alive():
                worker.process.kill()
        for worker in self._workers:
            worker.process.join()
            worker.tasks.close()
            worker.results.close()

    def _send_next(self, index: int, stream: Iterator[Any]) -> bool:
        item = next(stream, _END)
        if item is _END:
            return False
        try:
            self._workers[index].tasks.send(item)
        except OSError as error:
            raise self._died(index) from error
        return True

    def _await_ready(self, index: int, interrupt: Callable[[], None]) -> None:
        # Until its reader thread runs, a worker does not drain its pipe and a send could block.
        if not self._workers[index].ready:
            if self._receive(index, interrupt) != _READY:
                raise WorkerError(f"worker {index} sent a result before it was ready")
            self._workers[index].ready = True

    def _receive(self, index: int, interrupt: Callable[[], None]) -> Any:
        results = self._workers[index].results
        try:
            while not results.poll(POLL_SECONDS):
                interrupt()
            ok, value = results.recv()
        except (EOFError, OSError) as error:
            raise self._died(index) from error
        if not ok:
            raise WorkerError(f"worker {index} failed:\n{value}")
        return value

    def _died(self, index: int) -> WorkerError:
        process = self._workers[index].process
        process.join(timeout=1.0)
        return WorkerError(f"worker {index} died (exit code {process.exitcode})")


_END = object()
_READY = "ready"
