"""train/stop.py's vote on a stop signal, on 2 gloo ranks: what each rank reads at each step
boundary when one rank, or both, received a signal."""

import json
import signal

import torch.distributed as dist
from ranks import run_ranks

from moefold.train.stop import StopVote

# Per step boundary: (rank 0's signal, rank 1's signal, read at once)
BOUNDARIES = [(None, None, False),
              (None, signal.SIGINT, False),  # rank 1 alone: read at the next boundary
              (None, None, False),
              (signal.SIGTERM, signal.SIGINT, True)]  # read at once; SIGTERM over SIGINT


def vote_on_rank(rank: int, out) -> None:
    dist.init_process_group("gloo")
    vote = StopVote()
    read = [vote.agreed(signals[rank], now=now) for *signals, now in BOUNDARIES]
    (out / f"rank{rank}.json").write_text(json.dumps(read))


def test_every_rank_reads_the_signal_any_rank_had_at_the_same_boundary(tmp_path):
    run_ranks(2, vote_on_rank, tmp_path)
    expected = [None, None, signal.SIGINT, signal.SIGTERM]
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)] == [expected, expected]
