"""Ranks for the multi-process tests: `fn(rank, *args)` in `world` spawned processes joined as
torchrun would (env://: the rank's RANK, WORLD_SIZE, LOCAL_RANK and a free local port), ending as
the CLI's ranks do. An exception on any rank fails the caller."""

import faulthandler
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moefold.parallel.launch import exit_rank, free_port, leave


# Ranks fork from one server process that imported these once per test session: started fresh
# ("spawn"), every rank spent 4 s of CPU importing them, 20 s of a test's wall time for 8 ranks on
# the CI machine's two cores. The server imports nothing else and starts no thread, so forking it is
# safe; each rank gets the caller's sys.path and working directory (not its later os.environ).
PRELOADED = ["torch", "torch.distributed", "moefold.train.trainer", "moefold.plan.measure"]


def run_ranks(world: int, fn, *args) -> None:
    mp.get_context("forkserver").set_forkserver_preload(PRELOADED)
    mp.start_processes(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True,
                       start_method="forkserver")


def _entry(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # several ranks share the CI machine's two cores
    faulthandler.enable()  # an abort prints every thread's Python stack
    try:
        fn(rank, *args)
        if dist.is_initialized():
            dist.barrier()  # nobody tears gloo down while a peer still talks to it (SIGABRT)
    finally:
        leave()
    exit_rank(0)  # as the CLI's ranks do: no interpreter shutdown racing gloo's threads
