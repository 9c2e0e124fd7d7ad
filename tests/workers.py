"""A pool of real gloo processes shared by every multi-process test.

Spawning a rank costs ~13 s on 2 cores, so one pool of 4 ranks serves the whole session: a task for
P ranks runs on ranks 0..P-1 over a process group of exactly those ranks (one group of ranks 0..P-1 for
every P below the world, made once at start-up). A task is a module-level function, kept next to the test that runs it
(shared builders and tasks live in ``shared.py``); results come back per rank, and a failure on any rank
re-raises here with that rank's traceback.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import multiprocessing.util
import os
import queue
import socket
import sys
import time
import traceback

import torch.multiprocessing as mp

TASK_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raise_recompile_limits() -> None:
    """Every test compiles the same model classes with a new CPModule (a new backend), and dynamo caps the
    compiled entries per code object; a test session needs more than a training job does."""
    import torch

    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.accumulated_recompile_limit = 4096


def _worker(rank: int, world: int, port: int, tasks, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHINDUCTOR_COMPILE_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    raise_recompile_limits()
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    groups = {world: dist.group.WORLD}
    for size in range(1, world):  # every rank takes part in making each group, members or not
        groups[size] = dist.new_group(list(range(size)))
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=5)
        except queue.Empty:
            if os.getppid() != parent:  # the test process is gone (killed): do not hold memory as an orphan
                break
            continue
        if task is None:
            break
        name, size, kwargs = task
        try:
            results.put((rank, True, _task(name)(groups[size], **kwargs)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()
    # multiprocessing's own exit (its queues flushed), then none of the interpreter's: freeing a session's
    # compiled graphs at shutdown took ~15 CPU-s a rank.
    multiprocessing.util._exit_function()
    os._exit(0)


def _task(name: str):
    """The function ``<module>:<function>`` names (what :meth:`WorkerPool.run` sends for a task)."""
    import importlib

    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


class WorkerPool:
    def __init__(self, world: int = 4):
        self.world = world
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.tasks = [ctx.Queue() for _ in range(self.world)]
        self.results = ctx.Queue()
        port = _free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, self.world, port, self.tasks[r], self.results), daemon=True)
                      for r in range(self.world)]
        for p in self.procs:
            p.start()

    def run(self, task, size: int, timeout: float = TASK_TIMEOUT_S, **kwargs) -> list:
        """Run ``task(group, **kwargs)`` on ranks 0..size-1; return their results in rank order. ``task`` is a
        module-level function: each rank imports its module and calls it.

        A task that has not finished on every rank after ``timeout`` seconds is a hang: the pool is replaced
        (hung ranks cannot take another task) and the test fails. A task that failed on some rank also
        replaces the pool, so that one failure does not leave the next test's collectives mismatched."""
        assert 1 <= size <= self.world, size
        name = f"{task.__module__}:{task.__qualname__}"
        for r in range(size):
            self.tasks[r].put((name, size, kwargs))
        out, errors, answered = {}, [], set()
        deadline = time.monotonic() + timeout
        for _ in range(size):
            try:
                rank, ok, payload = self.results.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                waiting = sorted(set(range(size)) - answered)
                self.close(force=True)
                self._start()
                raise RuntimeError(f"{name} on {size} ranks hung: ranks {waiting} still running after {timeout} s")
            answered.add(rank)
            (out.__setitem__(rank, payload) if ok else errors.append(f"rank {rank}:\n{payload}"))
        if errors:  # the failed ranks may have left a collective half done: later tasks get fresh ranks
            self.close(force=True)
            self._start()
            raise RuntimeError(f"{name} failed on {size} ranks\n" + "\n".join(errors))
        return [out[r] for r in range(size)]

    @contextlib.contextmanager
    def stopped(self):
        """No workers inside: a worker keeps the memory its earlier tasks grew (the allocator does not give it back),
        and a case whose one-device run needs most of the machine runs that first, here, then starts fresh
        workers for its ranks. This process's freed memory goes back to the system too (``malloc_trim``)."""
        self.close()
        gc.collect()
        if sys.platform.startswith("linux"):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        try:
            yield
        finally:
            self._start()

    def close(self, force: bool = False) -> None:
        if force:
            for p in self.procs:
                p.kill()
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
