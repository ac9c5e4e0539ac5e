"""Ranks agreeing on a stop signal (SIGINT, SIGTERM) at every step boundary, off the training stream.

A signal may reach one rank only (a scheduler signalling one node's processes) or the ranks at
different moments; they must all stop at the same step, or the ones still training wait in the
next step's collectives until a timeout. So at each step boundary every rank starts an all-reduce
(MAX) of the signal it has received (0: none) and waits for the one it started at the boundary
before, which had a whole step to complete: a signal stops every rank after the step it arrived
in or the next. The all-reduce runs on a gloo group of its own, created once: a CPU collective,
so waiting for it never waits for the GPU (no host sync of the training stream, unlike an NCCL
all-reduce read with `.item()`), and it never queues behind the training's own collectives.
MAX makes every rank report the same signal (SIGTERM over SIGINT), hence exit with the same status.
The trainer learns the vote a boundary will read before the step ends (`settled`, where it would read
the next step's batches ahead): a step the ranks stop after reads nothing ahead.
"""

import torch
import torch.distributed as dist


class StopVote:
    """One rank's side of the vote; every rank calls `agreed` at every step boundary, with the
    same `now`. Build it on every rank at the same point (it creates a process group)."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo")
        self._pending: tuple[dist.Work, torch.Tensor] | None = None

    def agreed(self, signum: int | None, now: bool = False) -> int | None:
        """The signal any rank had received by the previous boundary (the largest one), or None;
        then the vote on `signum` (this rank's, None: none) is started, to be read at the next
        boundary. `now`: read at this one instead, where the ranks wait anyway (a save, the last
        step, after which no boundary would read it)."""
        earlier = self._wait()
        if earlier is not None:  # the same on every rank: none starts another vote
            return earlier
        flag = torch.tensor([signum or 0], dtype=torch.int32)
        self._pending = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flag
        return self._wait() if now else None

    def settled(self) -> int | None:
        """What the next `agreed` reads first: the signal any rank had by the previous boundary, or
        None; waited for now instead (no collective of its own: every rank reads the same vote).
        Called mid-step, it lets the ranks agree on a stop at the step's end before they read ahead."""
        if self._pending is None:
            return None
        work, flag = self._pending
        work.wait()  # a CPU collective: waits for the other ranks, not for a device; done, at once
        return int(flag.item()) or None

    def _wait(self) -> int | None:
        """`settled`, then the vote is spent: the next boundary starts another."""
        signal = self.settled()
        self._pending = None
        return signal
