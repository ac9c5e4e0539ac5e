"""Audit of the training step's data (eighth pass): each data rank reads only its rows (7901f2e), so a
token id outside the vocabulary shows on one rank, and every rank must stop with its line. The
agreement first waited, every step, for every rank's reads (a blocking all-reduce on the host); it
now rides one step ahead (train/step_data.py), as the stop vote does. References: a loader that
read exactly the steps trained (the checkpointed position), the single-process global batch (bench).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from moefold.data.loader import PackedSequences, TrainLoader, Vocabulary
from moefold.errors import DataError
from moefold.train.step_data import StepBatches

sys.path.insert(0, str(Path(__file__).parents[1]))
from ranks import run_ranks  # noqa: E402

SEQ = 8


def _loader(tokens_N: np.ndarray, batch_size: int = 4, accum: int = 2) -> TrainLoader:
    return TrainLoader(PackedSequences(tokens_N, SEQ), batch_size, seed=3, eos_id=0,
                       vocab=Vocabulary(100, "test", "tokens"), step_size=batch_size * accum)


def _ids(batches) -> list[list[list[int]]]:
    return [b.input_ids_BS.tolist() for b in batches]


@pytest.mark.parametrize("steps", [1, 2, 5])
def test_a_checkpoint_holds_the_position_of_the_steps_trained_not_the_one_read_ahead(steps):
    tokens_N = np.arange(40 * SEQ + 1) % 97
    step_batches, reference = StepBatches(_loader(tokens_N), 2, None), _loader(tokens_N)
    for _ in range(steps):
        got = step_batches.next_step()
        assert _ids(got) == _ids([reference.next_batch() for _ in range(2)])
        step_batches.read_ahead()
    assert step_batches.state_dict() == reference.state_dict()
    resumed = StepBatches(_loader(tokens_N), 2, None)
    resumed.load_state_dict(step_batches.state_dict())
    expected = _ids([reference.next_batch() for _ in range(2)])
    assert _ids(resumed.next_step()) == expected
    assert _ids(step_batches.next_step()) == expected  # the batches read ahead are the next step's


def test_a_bad_id_read_ahead_stops_the_step_it_belongs_to_not_the_one_before():
    tokens_N = np.arange(40 * SEQ + 1) % 97
    order = _loader(tokens_N).epoch_order(0).tolist()
    tokens_N[order[9] * SEQ + 1] = 5000  # the second step's second micro-batch (rows 8..15)
    step_batches = StepBatches(_loader(tokens_N), 2, None)
    step_batches.next_step()
    step_batches.read_ahead()  # reads the bad rows: said when that step starts
    with pytest.raises(DataError, match="token id 5000 in a training batch is outside the vocabulary"):
        step_batches.next_step()


# ------------------------------------------------------------------------------ on 2 gloo ranks


def _first_two_steps_on_rank(rank: int, tokens_path: Path, out_dir: Path) -> None:
    from conftest import TINY_OVERRIDES

    from moefold.config import load_config
    from moefold.data import corpus
    from moefold.parallel.launch import exit_rank
    from moefold.train.trainer import Trainer

    corpus._VOCAB_CHECK_TOKENS = 64  # the startup check reads each file's head only
    cfg = load_config(None, {**TINY_OVERRIDES, "data.path": str(tokens_path), "data.val_fraction": "0",
                             "train.micro_batch_size": "4", "parallel.ep": "2"})
    trainer = Trainer(cfg, out_dir / f"run{rank}", out=lambda line: None)
    said = []
    for _ in range(2):
        try:
            trainer.accumulate_gradients()
            said.append(f"trained, data at {trainer.step_batches.state_dict()}")
        except Exception as e:  # noqa: BLE001 - what each rank met is the result
            said.append(f"{type(e).__name__}: {e}")
            break
    (out_dir / f"rank{rank}.txt").write_text("\n".join(said))
    exit_rank(0)  # at once: a rank left in a collective fails on the connection, not a hang


def test_a_bad_id_in_one_rank_rows_of_the_next_step_stops_every_rank_before_it(tmp_path):
    """Rank 1's rows of step 2 hold id 5000 (vocabulary 257): step 1 trains on both ranks (its
    checkpoint would hold the position after step 1, not after the step read ahead), then both
    raise the same DataError before step 2's forward."""
    seq_len, num_sequences = 32, 127
    order = torch.randperm(num_sequences, generator=torch.Generator().manual_seed(0)).tolist()
    bad_sequence = next(i for i in order[12:16] if i >= 3)  # rank 1's rows of step 2, past the head
    tokens_N = (np.arange(num_sequences * seq_len + 1) % 250).astype(np.uint16)
    tokens_N[bad_sequence * seq_len + 5] = 5000
    np.save(tmp_path / "tokens.npy", tokens_N)
    run_ranks(2, _first_two_steps_on_rank, tmp_path / "tokens.npy", tmp_path)
    said = [(tmp_path / f"rank{rank}.txt").read_text().splitlines() for rank in range(2)]
    assert said[0] == said[1], said
    assert said[0][0] == "trained, data at {'epoch': 0, 'cursor': 8}"
    assert said[0][1].startswith(f"DataError: data.path={tmp_path / 'tokens.npy'}: token id 5000 in a "
                                 "training batch is outside the vocabulary [0, 257)")


class _WaitingLoader:
    """Rank 1's loader: its second step's read waits for rank 0 to say its own read-ahead returned."""

    def __init__(self, flag: Path):
        self.flag, self.reads = flag, 0

    def next_batch(self):
        from moefold.data.loader import make_batch

        self.reads += 1
        if self.reads == 2:
            deadline = time.monotonic() + 20
            while not self.flag.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return make_batch(torch.zeros(1, SEQ + 1, dtype=torch.int64), 0)


def _read_ahead_on_rank(rank: int, out_dir: Path) -> None:
    import torch.distributed as dist

    from moefold.data.loader import make_batch

    dist.init_process_group("gloo")
    flag = out_dir / "rank0_read_ahead"
    loader = _WaitingLoader(flag) if rank == 1 else type("Quick", (), {"next_batch": staticmethod(
        lambda: make_batch(torch.zeros(1, SEQ + 1, dtype=torch.int64), 0))})()
    step_batches = StepBatches(loader, 1, dist.new_group(backend="gloo"))
    step_batches.next_step()
    step_batches.read_ahead()  # rank 1's waits for the flag: rank 0's must return without it
    if rank == 0:
        flag.write_text("")
    waited = rank == 1 and not flag.exists()
    step_batches.next_step()
    (out_dir / f"rank{rank}.txt").write_text("waited in vain" if waited else "ok")


def test_reading_ahead_waits_for_no_other_rank(tmp_path):
    """The step's agreement on its data is waited for a step later: rank 0's read-ahead returns
    while rank 1 still reads (a blocking agreement held rank 0 until rank 1's 20 s ran out)."""
    run_ranks(2, _read_ahead_on_rank, tmp_path)
    assert [(tmp_path / f"rank{rank}.txt").read_text() for rank in range(2)] == ["ok", "ok"]


def _bench_rows_on_rank(rank: int) -> list[list[int]]:
    from moefold.bench.run import BenchTrainer
    from moefold.config import load_config

    cfg = load_config("tiny", {"train.micro_batch_size": "2", "train.seq_len": "8", "train.device": "cpu"})
    trainer = BenchTrainer(cfg, Path(tempfile.gettempdir()) / "moefold-bench-no-run-dir", out=lambda line: None)
    return trainer.step_batches.next_step()[0].input_ids_BS.tolist()


def test_bench_ranks_train_on_their_rows_of_the_global_batch(tmp_path):
    """Bench's random tokens, like the training data, are a global batch each data rank takes its
    rows of (each rank ran the whole global batch once the trainer stopped slicing it)."""
    from test_parallel_dims import results_on_ranks

    from moefold.bench.run import RandomTokens
    from moefold.config import load_config

    rows_by_rank = results_on_ranks(_bench_rows_on_rank, 2, tmp_path)
    cfg = load_config("tiny", {"train.micro_batch_size": "4", "train.seq_len": "8"})
    one_rank = RandomTokens(4, 8, cfg.model.vocab_size or 257, cfg.train.seed).next_batch()
    assert rows_by_rank[0] + rows_by_rank[1] == one_rank.input_ids_BS.tolist()
