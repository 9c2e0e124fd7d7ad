"""Run a per-rank function on P CPU processes with gloo: under torchrun, or spawned here."""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    _run_rank(fn, args)


def _run_rank(fn, args):
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    try:
        return fn(*args)
    finally:
        dist.destroy_process_group()


def launch(fn, nproc: int, *args) -> None:
    """Call ``fn(*args)`` on every rank. Under torchrun (RANK/WORLD_SIZE set) this process is one rank;
    otherwise ``nproc`` processes are spawned. A failing rank fails the launch."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _run_rank(fn, args)
        return
    mp.start_processes(_entry, args=(nproc, _free_port(), fn, args), nprocs=nproc, start_method="spawn")
