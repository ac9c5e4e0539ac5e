"""Joining the job: torchrun's environment → process group, device and this rank's layout.

`torchrun --nproc-per-node N -m moefold train ...` (or `moefold train --nproc N`, which starts the
N processes the same way on this machine) sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT; NCCL on GPUs (one process per GPU), gloo on CPU. Without them the job is one process
and no process group is created (under torchrun with one rank it still is: the parallel code path
with every group of size 1).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from moefold.config import Config
from moefold.errors import RANK_REPORTS_ENV, ConfigError
from moefold.parallel.dims import ParallelDims, ParallelLayout


@dataclass
class DistributedContext:
    rank: int
    world: int
    layout: ParallelLayout | None  # None in a one-process job

    @property
    def is_main(self) -> bool:
        """Rank 0 prints, writes metrics and the run directory; every rank writes its checkpoint
        shards."""
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        return self.layout.attention_coords[1] if self.layout else 0

    @property
    def dp_size(self) -> int:
        return self.layout.dims.dp if self.layout else 1

    def barrier(self) -> None:
        if self.layout is not None:
            dist.barrier()

    def sum_over_data(self, values: torch.Tensor) -> torch.Tensor:
        """Sum over the data ranks (dp·cp), which saw different shares of the batch."""
        if self.layout is None or self.layout.dims.dp * self.layout.dims.cp == 1:
            return values
        values = values.clone()
        dist.all_reduce(values, group=self.layout.dp_cp_group)
        return values

    def mean_over_data(self, values: torch.Tensor) -> torch.Tensor:
        data_ranks = self.layout.dims.dp * self.layout.dims.cp if self.layout else 1
        return self.sum_over_data(values) / data_ranks


def world_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


TRAIN_LAUNCH = "torchrun --nproc-per-node N -m moefold train or moefold train --nproc N"
"""How to start the ranks of `moefold train` (the hint of a layout one process cannot hold)."""


def join(cfg: Config, device_name: str, launch: str = TRAIN_LAUNCH
         ) -> tuple[DistributedContext, torch.device]:
    """Initialise the process group when launched with several ranks, and build the layout; the
    device is cuda:LOCAL_RANK on GPUs. Checks the layout against the world size first; `launch`
    says how the command that joins starts its ranks, for a layout one process cannot hold."""
    world = world_from_env()
    p = cfg.parallel
    try:
        dims = ParallelDims(world, p.tp, p.cp, p.pp, p.ep, p.etp, p.order)
    except ConfigError as e:
        hint = f" (one process: launch the ranks with {launch})" if world == 1 else ""
        raise ConfigError(f"{e}{hint}") from None
    if world == 1 and "MASTER_ADDR" not in os.environ:  # not launched by torchrun: one process
        return DistributedContext(0, 1, None), _device(device_name, None)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _device(device_name, local_rank)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    layout = ParallelLayout(dims, device.type)
    # Every rank holds its groups before any may stop: rank 0 hosts the rendezvous store, and a
    # rank that stops on a user error (a missing data file) while a peer still builds its groups
    # would fail that peer with a connection error and a C++ traceback instead of the one line.
    dist.barrier()
    return DistributedContext(dist.get_rank(), world, layout), device


def resolve_device(name: str, option: str = "train.device") -> torch.device:
    """train.device (or `option`): auto (cuda when available, else cpu), cpu or cuda."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{option}='cuda' but no CUDA device is available (use auto or cpu)")
    return torch.device(name)


def _device(name: str, local_rank: int | None) -> torch.device:
    """`resolve_device`, then on GPUs this rank's: cuda:LOCAL_RANK, made current."""
    device = resolve_device(name)
    if device.type != "cuda" or local_rank is None:
        return device
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs are "
                          "visible (launch one process per GPU)")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_rank(code: int) -> NoReturn:
    """End a rank's process now, skipping interpreter shutdown. The backends' worker threads
    outlive destroy_process_group (DTensor's caches keep meshes, and so their groups, reachable),
    and a worker that frees a tensor while Python finalizes needs the GIL: Python ends that thread
    inside a C++ destructor, which aborts the process ('terminate called without an active
    exception', SIGABRT) after a run that succeeded. Whatever the run wrote is closed by then."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---------------------------------------------------------------------------------------------
# `moefold train --nproc N`: start N local ranks the way torchrun --standalone does
# ---------------------------------------------------------------------------------------------


STOP_GRACE_S = 30.0
"""How long the ranks left after one failed have to end on SIGTERM before SIGKILL (torchrun's)."""


RANK_RUNTIME_BYTES = 256 * 2**20
"""Host memory a rank's Python interpreter with torch loaded takes before it holds any tensor (300
MiB measured with torch 2.13 on Linux): a floor, so `--nproc N` cannot start more ranks than the
host can hold."""


def refuse_more_ranks_than_the_host_holds(nproc: int, device: torch.device) -> None:
    """`--nproc N` starts N processes on this machine: on GPUs one per GPU, so more ranks than
    visible GPUs is refused (each extra rank would fail alone, naming its LOCAL_RANK); on the CPU
    more than the host's memory holds at RANK_RUNTIME_BYTES each (they would fill it, rank by
    rank, before the first step). Checked once, before any rank starts."""
    if device.type == "cuda":
        gpus = torch.cuda.device_count()
        if nproc > gpus:
            visible = "1 GPU is" if gpus == 1 else f"{gpus} GPUs are"
            raise ConfigError(f"--nproc {nproc}: only {visible} visible; start at most one rank per GPU "
                              "(train.device='cpu' runs the ranks on the CPU with gloo)")
        return
    from moefold.plan.fit import GIB, host_memory_bytes

    host = host_memory_bytes()
    if host is not None and nproc * RANK_RUNTIME_BYTES > host:
        raise ConfigError(f"--nproc {nproc}: {nproc} ranks need at least {nproc * RANK_RUNTIME_BYTES / GIB:,.1f} GiB "
                          f"for their Python and torch runtimes alone ({RANK_RUNTIME_BYTES / GIB:g} GiB each), and "
                          f"this host has {host / GIB:.1f} GiB of RAM and swap; start at most "
                          f"{max(1, host // RANK_RUNTIME_BYTES)}")


def spawn_local(nproc: int, argv: list[str]) -> int:
    """Run `python -m moefold <argv>` as N ranks on this machine (env:// rendezvous on a free local
    port): `run_local_ranks`."""
    return run_local_ranks(nproc, [sys.executable, "-m", "moefold", *argv])


def run_local_ranks(nproc: int, command: list[str]) -> int:
    """Run `command` as N ranks; returns 0, or the first failed rank's exit status (128 + signal
    where a signal ended it), after stopping the others. SIGINT and SIGTERM sent to this process
    reach every rank (they save a checkpoint and stop, as one process does). The line each rank
    ends with (errors.report) is said here once, however many ranks said it; a rank killed before
    it could say anything (the out-of-memory killer's SIGKILL) is named here."""
    with tempfile.TemporaryDirectory(prefix="moefold-ranks-") as reports:
        base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), RANK_REPORTS_ENV: reports}
        base.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N ranks share this machine's cores
        ranks = _LocalRanks()
        try:
            with ranks.forwarding_signals():
                ranks.start(nproc, command, base)
                first_failed = ranks.wait()
        finally:
            say_rank_reports(Path(reports), len(ranks.procs))
    if first_failed is None:
        return 0
    rank, code = first_failed
    if code < 0 and not ranks.signalled:
        print(f"moefold: error: rank {rank} was killed by {_signal_name(-code)}{_SIGNAL_HINTS.get(-code, '')}; "
              "the other ranks were stopped", file=sys.stderr)
    return _exit_status(code)


_FORWARDED = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def _held(signals):
    """Hold `signals` back from this thread while in the block; they arrive at its end."""
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


class _LocalRanks:
    """The ranks this launcher started, and the exit codes that the signals it passed on ask for."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []
        self.stop_codes: set[int] = set()  # of a rank that stopped as a passed-on signal asked
        self.start_cut_short = False  # a signal came before every rank was started

    def start(self, nproc: int, command: list[str], env: dict[str, str]) -> None:
        """Start the ranks, one by one, under forwarding_signals: a signal passed on meanwhile
        reaches the ranks started so far and the rest are not started. Each rank ends with this
        launcher (`_end_with_the_launcher`); if starting one fails, the started ones are stopped."""
        launcher, prctl = os.getpid(), _prctl()  # looked up here: no dlopen between fork and exec
        try:
            for rank in range(nproc):
                if self.signalled:
                    self.start_cut_short = True
                    return
                with _held(_FORWARDED):  # a signal meanwhile is passed on once the rank is listed
                    self.procs.append(subprocess.Popen(
                        command, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                        preexec_fn=lambda: _end_with_the_launcher(launcher, prctl)))
        except BaseException:
            for proc in self.procs:
                proc.kill()
                proc.wait()
            raise

    @property
    def signalled(self) -> bool:
        """A signal sent to the launcher was passed on: the ranks are stopping."""
        return bool(self.stop_codes)

    @contextlib.contextmanager
    def forwarding_signals(self):
        previous = {}
        for signum in _FORWARDED:
            try:
                previous[signum] = signal.signal(signum, self._forward)
            except ValueError:  # not the main thread: signals stay with the caller
                pass
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _forward(self, signum, _frame) -> None:
        self.stop_codes |= {128 + signum, -signum}  # stopped as asked, or by it before a handler
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    def wait(self) -> tuple[int, int] | None:
        """Wait for every rank. Once one fails, stop the rest (SIGTERM, SIGKILL after
        STOP_GRACE_S): a failed rank leaves the others waiting in a collective. A rank that ends
        as a signal passed on asked (128 + it: checkpoint saved) has not failed; the others are
        left to finish theirs. Returns (rank, return code) of the first that ended non-zero, or
        None."""
        first_failed = None
        # ranks started before a signal cut the start short may wait for peers that never come
        kill_at = time.monotonic() + STOP_GRACE_S if self.start_cut_short else None
        pending = dict(enumerate(self.procs))
        while pending:
            for rank, proc in list(pending.items()):
                try:
                    rc = proc.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    continue
                del pending[rank]
                if rc != 0:
                    first_failed = first_failed or (rank, rc)
                    if kill_at is None and rc not in self.stop_codes:
                        kill_at = time.monotonic() + STOP_GRACE_S
                        for other in pending.values():
                            other.terminate()
            if kill_at is not None and time.monotonic() > kill_at:
                for other in pending.values():
                    other.kill()
        return first_failed


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _prctl():
    """libc's prctl on Linux, else None."""
    return ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _end_with_the_launcher(launcher: int, prctl) -> None:
    """In a rank, between fork and exec: SIGTERM when the launcher dies, even by a signal it cannot
    pass on (SIGKILL, the out-of-memory killer's), so no rank is left behind waiting for its peers
    (on Linux; elsewhere the launcher's forwarding is all). A launcher already gone: exit now.
    The signals the launcher held while starting it are the rank's again."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != launcher:
        os._exit(1)


def _exit_status(returncode: int) -> int:
    """A process's exit status as a shell gives it: 128 + N for one that signal N ended."""
    return 128 - returncode if returncode < 0 else returncode


_SIGNAL_HINTS = {signal.SIGKILL: " (the kernel's out-of-memory killer sends it: the job may need more "
                                 "host memory than this machine has)"}


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def say_rank_reports(folder: Path, nproc: int) -> None:
    """Each distinct line the ranks left in `folder` once, on stderr, in rank order; where the
    ranks disagree, each line names the ranks that said it."""
    ranks_by_line: dict[str, list[int]] = {}
    for rank in range(nproc):
        path = folder / f"rank{rank}"
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines() if path.exists() else []
        for line in lines:
            ranks_by_line.setdefault(line, []).append(rank)
    for line, ranks in ranks_by_line.items():
        said_by = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        print(line if len(ranks_by_line) == 1 else f"{line} ({said_by})", file=sys.stderr)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a local rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
