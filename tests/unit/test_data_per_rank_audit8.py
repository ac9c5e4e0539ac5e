"""Each data-parallel rank reads only its rows of the training and validation batches.

The trainer built the loaders with the global micro-batch (micro_batch_size · dp): every data rank
read, vocab-checked and kept all dp ranks' rows, then sliced its own with `tensor_split(dp)[rank]`
(at dp = 1,000, mbs 4, seq_len 4,096: ~131 MB read per rank per micro-batch). The reference here is
that old path: the global loader's batches, split by tensor_split.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from moefold.data import PackedSequences, TrainLoader, Vocabulary, val_batches
from moefold.errors import DataError

SEQ = 4


def _sequences(num_sequences: int) -> PackedSequences:
    return PackedSequences(np.arange(num_sequences * SEQ + 1), SEQ)


def _fields(batch) -> tuple[torch.Tensor, ...]:
    return batch.input_ids_BS, batch.labels_BS, batch.doc_ids_BS


def _assert_rank_rows(got, global_batch, rank: int, ranks: int, note) -> None:
    for got_t, global_t in zip(_fields(got), _fields(global_batch)):
        want_t = global_t.tensor_split(ranks)[rank]
        assert got_t.dtype == want_t.dtype and torch.equal(got_t, want_t), note


def _random_cases(count: int):
    rng = random.Random(8)
    for _ in range(count):
        dp, micro, accum = rng.randint(1, 5), rng.randint(1, 3), rng.randint(1, 3)
        step = dp * micro * accum
        # From shorter than one step (the across-epochs path) to a few steps per epoch.
        num_sequences = rng.randint(max(dp * micro, step // 2), 3 * step + 2)
        yield dp, micro, accum, num_sequences, rng.randint(0, 2**40)


@pytest.mark.parametrize("dp, micro, accum, num_sequences, seed", list(_random_cases(24)))
def test_each_rank_loader_gives_its_tensor_split_of_the_global_batches(dp, micro, accum,
                                                                       num_sequences, seed):
    sequences = _sequences(num_sequences)
    size, step = micro * dp, micro * dp * accum
    reference = TrainLoader(sequences, size, seed, eos_id=5, step_size=step)
    ranks = [TrainLoader(sequences, size, seed, eos_id=5, step_size=step, data_rank=r, data_ranks=dp)
             for r in range(dp)]
    for index in range(accum * 7):  # several epochs
        global_batch = reference.next_batch()
        for rank, loader in enumerate(ranks):
            batch = loader.next_batch()
            assert batch.input_ids_BS.shape[0] == micro
            _assert_rank_rows(batch, global_batch, rank, dp, (index, rank))
            assert loader.state_dict() == reference.state_dict()  # the position does not depend on dp


class _CountingSequences(PackedSequences):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.windows_read: list[int] = []

    def window(self, index: int) -> np.ndarray:
        self.windows_read.append(index)
        return super().window(index)


def test_a_rank_reads_only_its_rows_of_a_training_batch():
    """1 of 4 data ranks, micro-batch 2: the old loader read all 8 windows of every micro-batch."""
    sequences = _CountingSequences(np.arange(40 * SEQ + 1), SEQ)
    reference = TrainLoader(_sequences(40), 8, 3, eos_id=5, step_size=16)
    loader = TrainLoader(sequences, 8, 3, eos_id=5, step_size=16, data_rank=2, data_ranks=4)
    for _ in range(12):
        want = reference.next_batch().input_ids_BS[:, 0].tensor_split(4)[2] // SEQ
        sequences.windows_read.clear()
        loader.next_batch()
        assert sequences.windows_read == want.tolist()


def test_a_rank_reads_only_its_rows_of_the_validation_batches():
    """5 validation sequences, micro-batch 8 (more than there are: one batch of all 5), dp 3:
    split 2, 2, 1."""
    for rank, want in enumerate([[0, 1], [2, 3], [4]]):
        sequences = _CountingSequences(np.arange(5 * SEQ + 1), SEQ)
        batches = val_batches(sequences, 8, 4, eos_id=-1, data_ranks=3, data_rank=rank)
        assert sequences.windows_read == want
        assert [b.input_ids_BS.shape[0] for b in batches] == [len(want)]


@pytest.mark.parametrize("num_sequences, micro, num_batches, dp", [
    (10, 3, 5, 2), (7, 2, 2, 4), (2, 3, 4, 3), (30, 2, 7, 3), (9, 4, 1, 5), (1, 1, 1, 2)])
def test_each_rank_validation_batches_are_the_tensor_split_of_the_global_ones(num_sequences, micro,
                                                                              num_batches, dp):
    from moefold.data.loader import val_batch_rows

    sequences = _sequences(num_sequences)
    everyone = val_batches(sequences, micro, num_batches, -1, data_ranks=dp)
    assert val_batch_rows(num_sequences, micro, num_batches, dp) == [b.input_ids_BS.shape[0] for b in everyone]
    for rank in range(dp):
        mine = val_batches(sequences, micro, num_batches, -1, data_ranks=dp, data_rank=rank)
        assert len(mine) == len(everyone)
        for index, (got, global_batch) in enumerate(zip(mine, everyone)):
            _assert_rank_rows(got, global_batch, rank, dp, (rank, index))


def test_a_resume_at_another_dp_reads_the_sequences_of_an_uninterrupted_global_run():
    """Saved by rank 1 of 2 data ranks, resumed on 3: each new rank's rows are its tensor_split of
    the global micro-batches that follow, as one process at the new global batch reads them."""
    sequences = _sequences(23)
    micro, accum, cut = 2, 2, 5
    saved_by = TrainLoader(sequences, micro * 2, 11, eos_id=5, step_size=micro * 2 * accum,
                           data_rank=1, data_ranks=2)
    for _ in range(cut * accum):
        saved_by.next_batch()
    state = dict(saved_by.state_dict())
    # Independent reference: one process, global batches, fast-forwarded with no checkpoint.
    reference = TrainLoader(sequences, micro * 2, 11, eos_id=5, step_size=micro * 2 * accum)
    for _ in range(cut * accum):
        reference.next_batch()
    assert reference.state_dict() == state
    resumed_global = TrainLoader(sequences, micro * 3, 11, eos_id=5, step_size=micro * 3 * accum)
    resumed_global.load_state_dict(state)
    ranks = []
    for rank in range(3):
        loader = TrainLoader(sequences, micro * 3, 11, eos_id=5, step_size=micro * 3 * accum,
                             data_rank=rank, data_ranks=3)
        loader.load_state_dict(state)
        ranks.append(loader)
    for index in range(4 * accum):
        global_batch = resumed_global.next_batch()
        for rank, loader in enumerate(ranks):
            _assert_rank_rows(loader.next_batch(), global_batch, rank, 3, (index, rank))


def test_a_bad_id_raises_on_the_rank_that_reads_it_and_only_there():
    """Sequence 5 holds id 999 (vocabulary 300). Rank by rank, the loaders of the first global
    micro-batch that holds it: the rank whose rows hold it raises, the others do not."""
    tokens_N = np.arange(12 * SEQ + 1) % 250
    tokens_N[5 * SEQ + 2] = 999
    vocab = Vocabulary(300, "bytes", "data.bin")
    sequences = PackedSequences(tokens_N, SEQ)
    reference = TrainLoader(sequences, 6, 1, eos_id=5)
    index = 0
    while 5 not in (reference.epoch_order(0)[index * 6:(index + 1) * 6]).tolist():
        index += 1
    order_B = reference.epoch_order(0)[index * 6:(index + 1) * 6]
    for rank in range(3):
        loader = TrainLoader(sequences, 6, 1, eos_id=5, vocab=vocab, data_rank=rank, data_ranks=3)
        for _ in range(index):
            loader.next_batch()
        if 5 in order_B.tensor_split(3)[rank].tolist():
            with pytest.raises(DataError, match="token id 999 in a training batch"):
                loader.next_batch()
        else:
            loader.next_batch()


def test_validation_pads_every_rank_to_the_largest_share(monkeypatch):
    """3 validation sequences over dp 2: rank 0 holds 2 rows, rank 1 one, padded to 2 (a row with
    no labels, no expert), as the global batch's tensor_split gave before."""
    import types

    from moefold.data.loader import IGNORE_INDEX, val_batch_rows
    from moefold.train.trainer import Trainer

    sequences = _sequences(3)
    for rank, rows in ((0, 2), (1, 1)):
        batches = val_batches(sequences, 4, 2, -1, data_ranks=2, data_rank=rank)
        fake = types.SimpleNamespace(
            dist=types.SimpleNamespace(dp_rank=rank, dp_size=2), device=torch.device("cpu"),
            cfg=types.SimpleNamespace(parallel=types.SimpleNamespace(tp=1)),
            _val_rows_any_rank=[-(-n // 2) for n in val_batch_rows(3, 4, 2, 2)])
        fake._to_device = types.MethodType(Trainer._to_device, fake)
        input_ids_BS, labels_BS, valid_BS = Trainer._val_rows(fake, batches[0], 0)
        assert input_ids_BS.shape == (2, SEQ)
        assert bool((labels_BS[rows:] == IGNORE_INDEX).all())
        if rows == 2:
            assert valid_BS is None
        else:
            assert valid_BS[:, 0].tolist() == [True, False]


def _first_step_on_rank(rank: int, tokens_path: Path, out_dir: Path) -> None:
    from conftest import TINY_OVERRIDES

    from moefold.config import load_config
    from moefold.data import corpus
    from moefold.parallel.launch import exit_rank
    from moefold.train.trainer import Trainer

    corpus._VOCAB_CHECK_TOKENS = 64  # the startup check reads each file's head only
    cfg = load_config(None, {**TINY_OVERRIDES, "data.path": str(tokens_path), "data.val_fraction": "0",
                             "train.micro_batch_size": "4", "parallel.ep": "2"})
    trainer = Trainer(cfg, out_dir / f"run{rank}", out=lambda line: None)
    try:
        trainer.accumulate_gradients()
        said = "trained"
    except Exception as e:  # noqa: BLE001 - what each rank met is the result
        said = f"{type(e).__name__}: {e}"
    (out_dir / f"rank{rank}.txt").write_text(said)
    exit_rank(0)  # at once: a rank left in a collective fails on the connection, not a hang


def test_a_bad_id_in_one_data_rank_rows_stops_every_rank_with_its_line(tmp_path):
    """Rank 1's rows of the first micro-batch hold id 5000 (vocabulary 257); rank 0's do not. Rank 1
    alone raised and rank 0, in the forward's all-gather, failed on gloo's "Connection closed by
    peer" (a traceback under the launcher's line; on NCCL a wait until the launcher killed it).
    Both now raise the same DataError before the forward."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from ranks import run_ranks

    seq_len, num_sequences = 32, 127
    order = torch.randperm(num_sequences, generator=torch.Generator().manual_seed(0)).tolist()
    bad_sequence = next(i for i in order[4:8] if i >= 3)  # rank 1's rows, past the checked head
    tokens_N = (np.arange(num_sequences * seq_len + 1) % 250).astype(np.uint16)
    tokens_N[bad_sequence * seq_len + 5] = 5000
    np.save(tmp_path / "tokens.npy", tokens_N)
    run_ranks(2, _first_step_on_rank, tmp_path / "tokens.npy", tmp_path)
    said = [(tmp_path / f"rank{rank}.txt").read_text() for rank in range(2)]
    assert said[0] == said[1], said
    assert said[0].startswith(f"DataError: data.path={tmp_path / 'tokens.npy'}: token id 5000 in a "
                              "training batch is outside the vocabulary [0, 257)")


def _announce_on_rank(rank: int, corpus_path: Path, out_dir: Path) -> None:
    import dataclasses

    from conftest import TINY_OVERRIDES

    from moefold.config import load_config
    from moefold.data.loader import IGNORE_INDEX
    from moefold.train.trainer import Trainer

    cfg = load_config(None, {**TINY_OVERRIDES, "data.path": str(corpus_path), "train.micro_batch_size": "2",
                             "parallel.ep": "2"})
    said: list[str] = []
    trainer = Trainer(cfg, out_dir / f"run{rank}", out=said.append)
    unlabelled = [dataclasses.replace(b, labels_BS=torch.full_like(b.labels_BS, IGNORE_INDEX))
                  for b in trainer.val_batches]
    warned = []
    for unlabelled_ranks in ({0}, {0, 1}):
        if rank in unlabelled_ranks:
            trainer.val_batches = unlabelled
        said.clear()
        trainer._announce()
        warned.append(any("no validation token has a label" in line for line in said))
    (out_dir / f"rank{rank}.txt").write_text(repr(warned))


def test_the_no_label_warning_counts_every_data_rank_rows(tmp_path):
    """Each data rank holds only its validation rows: rank 0's all unlabelled while rank 1's have
    labels is no reason to warn (rank 0 speaks for the job and did); every rank's unlabelled is."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from conftest import write_text_corpus
    from ranks import run_ranks

    run_ranks(2, _announce_on_rank, write_text_corpus(tmp_path / "corpus"), tmp_path)
    assert (tmp_path / "rank0.txt").read_text() == "[False, True]"
