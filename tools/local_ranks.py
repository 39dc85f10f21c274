"""Run a function on N gloo ranks on loopback, one thread each, with timeouts everywhere.

The harness of the multi-rank tests and the CPU benchmarks (not part of the package). A
collective that never completes fails through gloo's timeout; a rank that hangs anyway is
killed when the whole run exceeds `timeout`, and the caller gets a RankFailure with what each
rank reported.
"""

from __future__ import annotations

import datetime
import io
import os
import queue as queue_module
import threading
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_ul.initialize import free_port as free_port  # tests import it from here

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=90)


class RankFailure(RuntimeError):
    """A rank raised, died or hung; the message holds its traceback or what is known."""


# What almost every rank imports: the fork server imports it once, where a spawned rank would
# spend seconds importing it again, for every rank of every run.
PRELOAD = ["torch", "torch.distributed", "megatron_ul.training.pretrain"]


def _rank_context():
    """Ranks are forked from a fork server (fresh state, like spawn, without the imports);
    spawned where the platform has no fork server."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # read when the server starts, on the first run
    return context


def _exit_when_orphaned(caller: int) -> None:
    """End this rank as soon as the process that started it is gone (killed: its own clean-up
    never ran). A rank's parent is the fork server, which does not stop its children, so
    without this a killed test or benchmark leaves its ranks computing."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            try:
                os.kill(caller, 0)
            except ProcessLookupError:
                os._exit(1)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


def _worker(
    rank: int, world: int, port: int, fn, args, queue, collective_timeout, environment, caller
) -> None:
    _exit_when_orphaned(caller)
    # A forked rank has the fork server's environment, which is older than the caller's.
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    try:
        # The parent's store is already listening on `port`: every rank joins as a client, so
        # no rank races another process for a port it was told is free.
        store = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=collective_timeout)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=collective_timeout
        )
        result = fn(rank, world, *args)
        # Send plain bytes: tensors put on the queue directly travel as shared-memory handles
        # that vanish if this process exits before the parent reads them.
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_local_ranks(
    fn,
    world: int,
    *args,
    timeout: float = 300.0,
    collective_timeout: datetime.timedelta = COLLECTIVE_TIMEOUT,
) -> list:
    """fn(rank, world, *args) on `world` new processes; returns the results in rank order.

    fn must be a module-level function (it is pickled by reference) and returns something
    torch.save can write."""
    ctx = _rank_context()
    queue = ctx.Queue()
    # Port 0: the kernel picks a port and the store keeps it bound for the whole run (picking a
    # free port and binding it later lost the race to another test now and then: EADDRINUSE).
    store = dist.TCPStore(
        "127.0.0.1", 0, None, is_master=True, wait_for_workers=False, timeout=collective_timeout
    )
    port = store.port
    procs = [
        ctx.Process(
            target=_worker,
            daemon=True,
            args=(
                r,
                world,
                port,
                fn,
                args,
                queue,
                collective_timeout,
                dict(os.environ),
                os.getpid(),
            ),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world and not errors:
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except queue_module.Empty:
                dead = [
                    r for r, p in enumerate(procs) if p.exitcode is not None and r not in results
                ]
                if dead:
                    errors.append(
                        f"ranks {dead} died (exit codes "
                        f"{[procs[r].exitcode for r in dead]}) without reporting"
                    )
                elif time.monotonic() > deadline:
                    errors.append(
                        f"distributed run timed out after {timeout}s; "
                        f"finished ranks: {sorted(results)}"
                    )
                continue
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:  # the other ranks will time out or fail; do not wait for them
                errors.append(f"rank {rank}:\n{payload}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        del store
    if errors:
        raise RankFailure("\n".join(errors))
    return [results[r] for r in range(world)]
