"""Run a function on N real processes joined by a gloo process group (CPU), collect results.

Used by every multi-process test: `results = run_distributed(fn, world_size, *args)` calls
`fn(rank, world_size, *args)` in each worker process after init_process_group (gloo, or
`backend="nccl"` with one GPU per process) and returns
the per-rank return values (picklable) in rank order. An exception in any rank fails the
call with that rank's traceback.
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from core.lifecycle import exit_without_teardown


def free_port() -> int:
    """A loopback port nothing listens on now (bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: What every worker imports first (torch alone is ~3 s of CPU per interpreter): the gloo workers
#: are forked from one server process that imported these once (multiprocessing's forkserver);
#: nothing else runs there, so each worker still starts with torch untouched: no threads, no
#: seed, no process group, no CUDA.
PRELOAD = ["torch", "torch.distributed", "torch.multiprocessing", "tests.support.distributed", "core.train.parallelize",
           "core.train.trainer", "core.state.checkpoint"]


def context(backend: str = "gloo"):
    """The multiprocessing context for workers: forkserver (torch preloaded) on Linux for CPU
    workers, spawn elsewhere and for CUDA ones (each GPU worker a fresh interpreter)."""
    if backend != "gloo" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _worker(rank, world_size, port, fn, args, queue, backend, environ=None):
    if environ is not None:  # the caller's environment now, as a spawned worker would inherit it
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)  # N processes share 2 cores; oversubscription only slows tests
    try:
        if backend == "nccl":  # one GPU per process
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=torch.device("cuda", rank))
        else:
            dist.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Plain pickle bytes, not the torch queue's tensor sharing: shared tensors are handed over
        # through this process's resource-sharer socket, which vanishes when the worker exits
        # before the parent has unpickled them (FileNotFoundError in the parent, seen in CI).
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report, then let the parent fail the test
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # The result is in the pipe once the queue's feeder thread is done; the interpreter's
    # teardown after that (collecting every object torch made) only delays the parent's join.
    queue.close()
    queue.join_thread()
    exit_without_teardown(0)


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0, backend: str = "gloo"):
    """`fn(rank, world_size, *args)` on `world_size` worker processes joined by one process group;
    their return values in rank order (see the module docstring)."""
    ctx = context(backend)
    queue = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, backend, environ))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
