"""A strict stand-in for NCCL's point-to-point semantics, for tests: the real schedules and the
real ring run in one process, one thread per rank, with torch.distributed's p2p calls replaced.

gloo matches a receive to a send by (peer, tag) and buffers sends, so code that would hang on
NCCL passes on gloo. This stand-in enforces what NCCL does instead:

  - tags are ignored: the k-th send from rank a to rank b meets the k-th receive on b from a;
  - operations of one rank on one communicator (process group) run in issue order: a single
    isend/irecv/send/recv is one kernel, a batch_isend_irecv is one kernel whose operations are
    grouped (posted together, so a send and a receive of one batch never wait on each other),
    and a kernel starts only when the previous one on that communicator has finished;
  - rendezvous: a send completes only when the peer's matching receive is running (messages
    above NCCL's internal buffer, i.e. any real activation); `eager_bytes` lets smaller
    messages complete on their own, as NCCL's buffer does, to show what small tests hide;
  - a matched send and receive of different shape or dtype is an error, and so is one whose
    tags differ (the code labels its streams with tags; NCCL would deliver the message into
    the other stream's buffer);
  - a wait-for cycle fails fast: when every unfinished rank is blocked, each one raises
    `Deadlock` naming every rank's blocked operation and its pending kernels.

It also catches two buffer errors NCCL makes silent: a send buffer written before its send
completed (checked at delivery), and a receive buffer read before its wait (posted receive
buffers are filled with NaN until the data arrives).

Usage: `run_ranks(fn, world)` runs fn(rank) on `world` threads with torch.distributed's isend,
irecv, send, recv, batch_isend_irecv, P2POp, get_rank and get_world_size replaced, and returns
the results in rank order; `Group(ranks)` is the process group the code is handed.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from unittest import mock

import torch
import torch.distributed as dist

WAIT_LIMIT_S = 120.0  # a safety net only: deadlocks are detected, not timed out


class Deadlock(RuntimeError):
    """Every unfinished rank waits for an operation that cannot complete."""


class MessageMismatch(RuntimeError):
    """A matched send and receive disagree (shape, dtype or tag), or a buffer was misused."""


@dataclass(frozen=True, eq=False)
class Group:
    """A process group of the simulated world: its global ranks, in group order."""

    ranks: tuple[int, ...]

    def size(self) -> int:
        return len(self.ranks)

    def rank(self) -> int:
        return self.ranks.index(_current_rank())


@dataclass(eq=False)
class _Op:
    kind: str  # "send" or "recv"
    rank: int  # the rank that posted it
    peer: int
    tensor: torch.Tensor
    tag: int
    kernel: _Kernel
    seq: int = -1  # index among this direction's messages on the rank pair
    snapshot: torch.Tensor | None = None
    done: bool = False

    def describe(self) -> str:
        arrow = "->" if self.kind == "send" else "<-"
        state = "done" if self.done else "pending"
        return (
            f"{self.kind} #{self.seq} {self.rank}{arrow}{self.peer} tag={self.tag} "
            f"{tuple(self.tensor.shape)} {self.tensor.dtype} [{state}]"
        )


@dataclass(eq=False)
class _Kernel:
    rank: int
    group: Group
    label: str  # "batch_isend_irecv" or the single op's name
    ops: list = field(default_factory=list)
    running: bool = False

    @property
    def done(self) -> bool:
        return all(op.done for op in self.ops)

    def describe(self) -> str:
        return f"{self.label}[{', '.join(op.describe() for op in self.ops)}]"


class _Work:
    """What isend/irecv/batch_isend_irecv return: wait() blocks until the op's kernel is done
    (on NCCL a batch is one kernel, so waiting on any of its works waits for all of it)."""

    def __init__(self, world: _World, op: _Op):
        self._world, self._op = world, op

    def wait(self, timeout=None) -> bool:
        self._world.wait(self._op)
        return True

    def is_completed(self) -> bool:
        with self._world.lock:
            return self._op.kernel.done


class _World:
    def __init__(self, world_size: int, eager_bytes: int):
        self.world_size, self.eager_bytes = world_size, eager_bytes
        self.lock = threading.Condition()
        self.queues: dict = defaultdict(list)  # (rank, group) -> kernels in issue order
        self.posted: dict = defaultdict(list)  # (group, kind, rank, peer) -> ops
        self.blocked: dict[int, _Op] = {}  # rank -> the op it waits for
        self.finished: set[int] = set()
        self.failure: BaseException | None = None

    # ---- posting ------------------------------------------------------------------------------
    def post(self, rank: int, group: Group, label: str, specs: list) -> list[_Op]:
        """specs: (kind, peer, tensor, tag). Returns the ops of one new kernel."""
        with self.lock:
            self._raise_failure()
            kernel = _Kernel(rank, group, label)
            for kind, peer, tensor, tag in specs:
                _check_op(rank, group, kind, peer, tensor)
                op = _Op(kind, rank, peer, tensor, tag, kernel)
                history = self.posted[(group, kind, rank, peer)]
                op.seq = len(history)
                history.append(op)
                if kind == "send":
                    op.snapshot = tensor.detach().clone()
                elif tensor.is_floating_point():
                    tensor.data.fill_(float("nan"))  # unread until the data arrives
                kernel.ops.append(op)
            queue = self.queues[(rank, group)]
            queue.append(kernel)
            if len(queue) == 1:
                self._start(kernel)
            self.lock.notify_all()
            return kernel.ops

    def _start(self, kernel: _Kernel) -> None:
        kernel.running = True
        for op in kernel.ops:
            if op.kind == "send" and _nbytes(op.tensor) <= self.eager_bytes:
                op.done = True  # fits NCCL's buffer: no rendezvous
            self._try_match(op)
        self._retire(kernel)

    def _try_match(self, op: _Op) -> None:
        other_kind = "recv" if op.kind == "send" else "send"
        history = self.posted[(op.kernel.group, other_kind, op.peer, op.rank)]
        if op.seq >= len(history):
            return
        other = history[op.seq]
        send, recv = (op, other) if op.kind == "send" else (other, op)
        if recv.done or not recv.kernel.running or not send.kernel.running and not send.done:
            return
        self._deliver(send, recv)
        self._retire(other.kernel)

    def _deliver(self, send: _Op, recv: _Op) -> None:
        problems = []
        if send.tensor.shape != recv.tensor.shape:
            problems.append(f"shape {tuple(send.tensor.shape)} != {tuple(recv.tensor.shape)}")
        if send.tensor.dtype != recv.tensor.dtype:
            problems.append(f"dtype {send.tensor.dtype} != {recv.tensor.dtype}")
        if send.tag != recv.tag:
            problems.append(
                f"tag {send.tag} != {recv.tag}: NCCL ignores tags, so this message "
                f"lands in the buffer of the other stream"
            )
        if not _same_bits(send.snapshot, send.tensor):
            problems.append("the send buffer was written before the send completed")
        if problems:
            raise self._fail(
                MessageMismatch(
                    f"send {send.describe()} matched receive {recv.describe()}: "
                    + "; ".join(problems)
                )
            )
        recv.tensor.data.copy_(send.snapshot)
        send.done = recv.done = True

    def _retire(self, kernel: _Kernel) -> None:
        """Pop finished kernels off the head of the rank's queue and start the next ones."""
        queue = self.queues[(kernel.rank, kernel.group)]
        while queue and queue[0].running and queue[0].done:
            queue.pop(0)
            if queue:
                self._start(queue[0])
                return

    # ---- waiting ------------------------------------------------------------------------------
    def wait(self, op: _Op) -> None:
        rank = op.rank
        with self.lock:
            self.blocked[rank] = op
            try:
                self._check_deadlock()
                ok = self.lock.wait_for(
                    lambda: op.kernel.done or self.failure is not None, timeout=WAIT_LIMIT_S
                )
                self._raise_failure()
                if not ok:
                    raise TimeoutError(
                        f"rank {rank}: {op.describe()} still pending after "
                        f"{WAIT_LIMIT_S} s (the stand-in missed a deadlock?)"
                    )
            finally:
                self.blocked.pop(rank, None)

    def finish(self, rank: int) -> None:
        with self.lock:
            self.finished.add(rank)
            if self.failure is None:
                self._check_deadlock()

    def abort(self, rank: int, error: BaseException) -> None:
        with self.lock:
            self.finished.add(rank)
            if self.failure is None:
                self.failure = error
            self.lock.notify_all()

    def _check_deadlock(self) -> None:
        live = set(range(self.world_size)) - self.finished
        stuck = {r: op for r, op in self.blocked.items() if not op.kernel.done}
        if live and set(stuck) == live:
            raise self._fail(Deadlock(self._report(stuck)))
        if not live:
            left = [k for queue in self.queues.values() for k in queue]
            if left:
                raise self._fail(
                    Deadlock(
                        "every rank finished with operations never "
                        "completed:\n  "
                        + "\n  ".join(f"rank {k.rank}: {k.describe()}" for k in left)
                    )
                )

    def _report(self, stuck: dict) -> str:
        lines = [
            "NCCL p2p deadlock: every unfinished rank waits for an operation that cannot "
            "complete (in-order per communicator, rendezvous sends, tags ignored)"
        ]
        for rank in sorted(stuck):
            lines.append(f"  rank {rank} waits for {stuck[rank].describe()}")
            for (r, group), queue in sorted(
                self.queues.items(), key=lambda item: (item[0][0], item[0][1].ranks)
            ):
                if r == rank and queue:
                    lines.append(
                        f"    on group {list(group.ranks)}: "
                        + " ; ".join(
                            ("running " if k.running else "queued ") + k.describe() for k in queue
                        )
                    )
        for rank in sorted(self.finished):
            lines.append(f"  rank {rank} has finished")
        return "\n".join(lines)

    def _fail(self, error: BaseException) -> BaseException:
        if self.failure is None:
            self.failure = error
        self.lock.notify_all()
        return self.failure

    def _raise_failure(self) -> None:
        """Stop a waiting rank once any rank has failed (run_ranks raises the original)."""
        if isinstance(self.failure, (Deadlock, MessageMismatch)):
            raise type(self.failure)(str(self.failure))
        if self.failure is not None:
            raise RuntimeError("another stand-in rank failed") from self.failure


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    same = a == b
    if a.is_floating_point():
        same |= a.isnan() & b.isnan()
    return bool(same.all())


def _check_op(rank: int, group: Group | None, kind: str, peer: int, tensor) -> None:
    if not isinstance(group, Group):
        raise TypeError(
            f"rank {rank}: {kind} on group {group!r}; the stand-in needs the "
            f"Group the code was handed (a p2p call on the default group?)"
        )
    if rank not in group.ranks or peer not in group.ranks:
        raise ValueError(
            f"rank {rank}: {kind} with peer {peer} outside group {group.ranks} "
            f"(peers are global ranks)"
        )
    if peer == rank:
        raise ValueError(f"rank {rank}: {kind} to itself")
    if not isinstance(tensor, torch.Tensor) or not tensor.is_contiguous():
        raise ValueError(
            f"rank {rank}: {kind} of a non-contiguous tensor (NCCL needs contiguous buffers)"
        )


# ---- the torch.distributed replacements ---------------------------------------------------------
_state = threading.local()


def _current_rank() -> int:
    rank = getattr(_state, "rank", None)
    if rank is None:
        raise RuntimeError("a torch.distributed p2p call outside a stand-in rank thread")
    return rank


def _world() -> _World:
    return _state.world


def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    (op,) = _world().post(_current_rank(), group, "isend", [("send", dst, tensor, tag)])
    return _Work(_world(), op)


def irecv(tensor, src=None, group=None, tag=0, group_src=None):
    (op,) = _world().post(_current_rank(), group, "irecv", [("recv", src, tensor, tag)])
    return _Work(_world(), op)


def send(tensor, dst=None, group=None, tag=0, group_dst=None):
    isend(tensor, dst, group, tag).wait()


def recv(tensor, src=None, group=None, tag=0, group_src=None):
    irecv(tensor, src, group, tag).wait()
    return src


class P2POp:
    """torch.distributed.P2POp's signature; op is (the replaced) isend or irecv."""

    def __init__(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        if op not in (isend, irecv, dist.distributed_c10d.isend, dist.distributed_c10d.irecv):
            raise ValueError("P2POp's op must be torch.distributed.isend or irecv")
        self.kind = "send" if op in (isend, dist.distributed_c10d.isend) else "recv"
        self.tensor, self.peer, self.group, self.tag = tensor, peer, group, tag


def batch_isend_irecv(p2p_op_list):
    if not p2p_op_list:
        raise ValueError("batch_isend_irecv of an empty list")
    group = p2p_op_list[0].group
    if any(op.group is not group for op in p2p_op_list):
        raise ValueError("batch_isend_irecv over several groups (NCCL groups one communicator)")
    ops = _world().post(
        _current_rank(),
        group,
        "batch_isend_irecv",
        [(op.kind, op.peer, op.tensor, op.tag) for op in p2p_op_list],
    )
    return [_Work(_world(), op) for op in ops]


def get_rank(group=None):
    rank = _current_rank()
    return rank if group is None else group.ranks.index(rank)


def get_world_size(group=None):
    return _world().world_size if group is None else group.size()


_REPLACED = {
    "isend": isend,
    "irecv": irecv,
    "send": send,
    "recv": recv,
    "P2POp": P2POp,
    "batch_isend_irecv": batch_isend_irecv,
    "get_rank": get_rank,
    "get_world_size": get_world_size,
}


def run_ranks(fn: Callable[[int], object], world_size: int, eager_bytes: int = 0) -> list:
    """fn(rank) on one thread per rank under NCCL's p2p rules; the results in rank order. The
    first error (a Deadlock, a MessageMismatch, or fn's own) is raised here."""
    world = _World(world_size, eager_bytes)
    results: list = [None] * world_size
    errors: list = [None] * world_size

    def body(rank: int) -> None:
        _state.rank, _state.world = rank, world
        torch.set_num_threads(1)  # ranks are the parallelism; don't oversubscribe cores
        try:
            results[rank] = fn(rank)
            world.finish(rank)
        except BaseException as error:
            errors[rank] = error
            world.abort(rank, error)

    threads = [
        threading.Thread(target=body, args=(r,), name=f"stand-in rank {r}")
        for r in range(world_size)
    ]
    patches = [mock.patch.object(dist, name, value) for name, value in _REPLACED.items()]
    for patch in patches:
        patch.start()
    threads_before = torch.get_num_threads()
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT_LIMIT_S * 2)
    finally:
        torch.set_num_threads(threads_before)
        for patch in reversed(patches):
            patch.stop()
    if any(thread.is_alive() for thread in threads):
        raise TimeoutError("stand-in ranks still running")
    if world.failure is not None:
        raise world.failure
    for error in errors:
        if error is not None:
            raise error
    return results
