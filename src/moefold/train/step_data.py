"""A step's micro-batches, read one step ahead and agreed on by the ranks off the training's path.

Each data rank reads and checks only its own rows (data/loader.py), so a token id outside the
vocabulary shows on one rank only. That rank stopping alone would leave the others in the next
collective (gloo: a peer's traceback under the line; NCCL: waiting until the launcher kills them).
So every rank reads the next step's batches while this step's kernels run, and starts an all-reduce
of whether it failed on a gloo group; the all-reduce is waited for when that step starts, having had
the rest of this step to complete (the stop vote's, train/stop.py, has the next step's micro-batches).
No per-step wait on the other ranks, no device sync. A step the run stops after reads nothing ahead
(Trainer._another_step_follows). A failure raises the first failed rank's DataError on every rank, before the step it
would have trained on, and before any checkpoint holds the loader's position past it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from moefold.data.loader import Batch
from moefold.errors import DataError


T = TypeVar("T")


class BatchSource(Protocol):
    def next_batch(self) -> Batch: ...


@dataclass
class _StepAhead:
    batches: list[Batch] | None
    error: DataError | None
    loader_state: dict[str, int] | None
    """The loader's position before these batches: what a checkpoint saved now must hold."""
    vote: tuple[dist.Work, torch.Tensor] | None


class StepBatches:
    """The training step's micro-batches from `loader`, `micro_batches` a step. `group`: the gloo
    group the ranks agree on over, None where every rank reads the same rows (one data rank) or
    runs alone; a failure is then raised at once."""

    def __init__(self, loader: BatchSource, micro_batches: int, group: dist.ProcessGroup | None):
        self.loader, self.micro_batches, self.group = loader, micro_batches, group
        self._ahead: _StepAhead | None = None

    def next_step(self) -> list[Batch]:
        """This step's micro-batches (read ahead by `read_ahead`, else now); the DataError any rank
        met reading them is raised on every rank."""
        ahead = self._ahead if self._ahead is not None else self._read()
        self._ahead = None
        _raise_first_failure(ahead.error, ahead.vote, self.group)
        return ahead.batches

    def read_ahead(self) -> None:
        """Read the next step's micro-batches now (while this step's kernels run) and start their
        vote; `next_step` waits for it."""
        if self._ahead is None:
            self._ahead = self._read()

    def state_dict(self) -> dict[str, int]:
        """The loader's position at the first batch not yet trained on."""
        if self._ahead is not None:
            return dict(self._ahead.loader_state)
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._ahead = None  # read from the old position
        self.loader.load_state_dict(state)

    def _read(self) -> _StepAhead:
        state = self.loader.state_dict() if hasattr(self.loader, "state_dict") else None
        try:
            batches, error = [self.loader.next_batch() for _ in range(self.micro_batches)], None
        except DataError as e:
            batches, error = None, e
        return _StepAhead(batches, error, state, _start_vote(error, self.group))


def read_agreed(read: Callable[[], T], group: dist.ProcessGroup | None) -> T:
    """`read()` on every rank, the DataError any rank met raised on every rank; waits for the
    others (for reads done once, as the validation batches at startup)."""
    try:
        value, error = read(), None
    except DataError as e:
        value, error = None, e
    _raise_first_failure(error, _start_vote(error, group), group)
    return value


_Vote = tuple[dist.Work, torch.Tensor]


def _start_vote(error: DataError | None, group: dist.ProcessGroup | None) -> _Vote | None:
    """An all-reduce (MIN) of the failed ranks' places in `group` (its size: none failed)."""
    if group is None:
        return None
    first_failed = torch.tensor([dist.get_world_size(group) if error is None else dist.get_rank(group)])
    return dist.all_reduce(first_failed, op=dist.ReduceOp.MIN, group=group, async_op=True), first_failed


def _raise_first_failure(error: DataError | None, vote: _Vote | None, group: dist.ProcessGroup | None) -> None:
    if vote is None:  # every rank read the same rows: the same error, or none
        if error is not None:
            raise error
        return
    work, first_failed = vote
    work.wait()  # a CPU collective: waits for the other ranks' reads, for no device
    failed = int(first_failed)
    if failed == dist.get_world_size(group):
        return
    message: list[Any] = [str(error)]
    dist.broadcast_object_list(message, src=dist.get_global_rank(group, failed), group=group)
    raise DataError(message[0]) from None
