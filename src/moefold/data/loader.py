"""Packing a token stream into fixed-length sequences, and the train / validation loaders.

Sequence i is the window `tokens[i*S : i*S + S + 1]`: its first S tokens are the inputs and its last
S the labels, so consecutive sequences share one boundary token (only the last (N - 1) % S tokens
go unused). Documents are packed back to back; `doc_ids` marks where each one starts, what
document masking needs, but the trainer does not pass it on yet: attention spans the whole
sequence, across documents (shared/design/FEATURES.md lists document masking as "later").

The train loader's order is a pure function of (seed, epoch), and its position is two integers, so
a resumed run sees exactly the batches the interrupted one would have.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from moefold.data.token_files import ConcatenatedTokens
from moefold.errors import DataError

IGNORE_INDEX = -100
"""The label of a position that has no target: it counts neither in a loss nor in the number of
tokens that loss is a mean over. -100 is `F.cross_entropy`'s default `ignore_index`, and the value
Hugging Face and Megatron-Core use for padding's labels."""


class PackedSequences:
    """A token stream seen as `(N - 1) // seq_len` overlapping windows of `seq_len + 1` tokens."""

    def __init__(self, tokens_N: np.ndarray | ConcatenatedTokens, seq_len: int,
                 name: str = "training"):
        self.tokens_N = tokens_N
        self.seq_len = seq_len
        if len(self) == 0:
            # A small corpus's validation share is what falls short: name its own option too.
            also = (", raise data.val_fraction or set it to 0 (no validation)"
                    if name == "validation" else "")
            raise DataError(f"train.seq_len={seq_len}: the {name} stream has {len(tokens_N)} "
                            f"tokens, fewer than train.seq_len + 1 = {seq_len + 1}; lower "
                            f"train.seq_len{also} or add data")

    def __len__(self) -> int:
        return max(len(self.tokens_N) - 1, 0) // self.seq_len

    def window(self, index: int) -> np.ndarray:
        """The S + 1 token ids of sequence `index`, in the stream's dtype: token files' read from the
        one or more files the window spans, text's a view of its array."""
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} out of range [0, {len(self)})")
        start = index * self.seq_len
        return np.asarray(self.tokens_N[start:start + self.seq_len + 1])

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.from_numpy(self.window(index).astype(np.int64))

    def gather(self, indices: Sequence[int]) -> torch.Tensor:
        """Sequences `indices` stacked into an int64 tensor [B, S+1] (B may be 0: a data rank
        left no row of a small validation batch)."""
        if len(indices) == 0:
            return torch.empty(0, self.seq_len + 1, dtype=torch.int64)
        windows_BS1 = np.stack([self.window(int(i)) for i in indices])
        return torch.from_numpy(windows_BS1.astype(np.int64))

    def id_range(self, indices: Sequence[int]) -> tuple[int, int]:
        """The least and greatest id of sequences `indices`, read in each file's own dtype:
        `gather`'s int64 turns a uint64 id past 2**63 negative."""
        lows, highs = [], []
        for index in indices:
            start = int(index) * self.seq_len
            view = self.tokens_N[start:start + self.seq_len + 1]
            # One piece at a time: a piece is read from its file, one of MAX_OPEN_TOKEN_FILES held open.
            for piece in view.pieces() if isinstance(view, ConcatenatedTokens) else [view]:
                if piece.size:
                    lows.append(int(piece.min()))
                    highs.append(int(piece.max()))
        return min(lows), max(highs)


@dataclass(frozen=True)
class Vocabulary:
    """The ids a batch may hold, [0, size), and what to name when one holds another id."""

    size: int
    tokenizer: str
    """data.tokenizer's name, for the message."""
    data_path: str
    """What data.path names, for the message."""

    def check(self, ids: torch.Tensor, split: str,
              exact_range: Callable[[], tuple[int, int]] | None = None) -> None:
        """Every id of the host tensor `ids` lies in [0, size). Checked per batch (two reductions)
        because the startup check reads only each token file's head (corpus.py), and an id past the
        embedding fails deep in the forward: an IndexError on CPU, a device-side assert on GPU.
        `exact_range`: the ids' (least, greatest) as read from the files, to name a bad one by its
        value (`ids` are int64, where a uint64 id past 2**63 is negative)."""
        if ids.numel() == 0:  # a data rank's empty share of a small validation batch
            return
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.size:
            if exact_range is not None:
                low, high = exact_range()
            bad = low if low < 0 else high
            raise DataError(f"data.path={self.data_path}: token id {bad} in a {split} batch is "
                            f"outside the vocabulary [0, {self.size}) of tokenizer "
                            f"{self.tokenizer}; set data.tokenizer to the tokenizer that produced "
                            "the data")


@dataclass
class Batch:
    input_ids_BS: torch.Tensor
    """int64 token ids."""
    labels_BS: torch.Tensor
    """int64: the next token of each input position, or IGNORE_INDEX where there is none to
    predict (padding; packed batches have none)."""
    doc_ids_BS: torch.Tensor
    """int32: index of the document each input position belongs to, from 0 in every sequence."""

    @property
    def num_tokens(self) -> int:
        return self.input_ids_BS.numel()

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(*(t.to(device, non_blocking=non_blocking)
                       for t in (self.input_ids_BS, self.labels_BS, self.doc_ids_BS)))


def document_ids(input_ids_BS: torch.Tensor, eos_id: int) -> torch.Tensor:
    """A new document starts at the position right after each EOS (the EOS ends its own)."""
    is_eos_BS = (input_ids_BS == eos_id).to(torch.int32)
    return torch.cumsum(is_eos_BS, dim=1, dtype=torch.int32) - is_eos_BS


def make_batch(windows_BS1: torch.Tensor, eos_id: int) -> Batch:
    """A batch from int64 windows [B, S+1]: inputs and labels are the same window, offset by one."""
    input_ids_BS = windows_BS1[:, :-1].contiguous()
    return Batch(input_ids_BS=input_ids_BS, labels_BS=windows_BS1[:, 1:].contiguous(),
                 doc_ids_BS=document_ids(input_ids_BS, eos_id))


class TrainLoader:
    """Endless batches of `batch_size` sequences, reshuffled every epoch.

    Epoch e visits the sequences in the order `randperm(len, (seed * 1_000_003 + e) mod 2**64)`,
    B at a time, up to its last whole optimizer step (`step_size` sequences); the rest of the order
    is dropped, so every batch holds exactly B sequences, and an epoch ends at the same sequence
    however a step is split into micro-batches and data ranks. A step longer than an epoch reads
    the epochs' orders back to back, nothing dropped, for the same reason.

    B is the global micro-batch of every data rank; each rank's loader walks the same order and
    state but reads and checks only its rows, `tensor_split(data_ranks)[data_rank]` of the B: at
    dp = 1,000 a rank reads its mbs sequences, not the 1,000 · mbs of the whole micro-batch.
    """

    def __init__(self, sequences: PackedSequences, batch_size: int, seed: int, eos_id: int, *,
                 vocab: Vocabulary | None = None, step_size: int | None = None,
                 data_rank: int = 0, data_ranks: int = 1):
        """`batch_size`: the global micro-batch, train.micro_batch_size on each data-parallel
        rank. `vocab`: the ids every batch is checked to hold; None checks nothing. `step_size`:
        sequences per optimizer step, a multiple of `batch_size` (default: `batch_size`).
        `data_rank` of `data_ranks`: whose rows of each batch this loader reads (default: all)."""
        if len(sequences) < batch_size:  # named as a product: under data parallelism it is one
            raise DataError(f"train.micro_batch_size · data-parallel ranks = {batch_size} "
                            f"sequences exceeds the {len(sequences)} training sequences of "
                            f"train.seq_len={sequences.seq_len} tokens; lower "
                            "train.micro_batch_size or train.seq_len, or add data")
        self.sequences = sequences
        self.batch_size = batch_size
        self.seed = seed
        self.eos_id = eos_id
        self.vocab = vocab
        self.data_rank, self.data_ranks = data_rank, data_ranks
        # An epoch ends where a whole step no longer fits, not a micro-batch: the micro-batch is
        # micro_batch_size · dp, and dropping its remainder made the data order depend on dp.
        self.step_size = step_size or batch_size
        self._step_batch = 0  # index in its step of the next micro-batch; a checkpoint is at 0
        self.epoch = 0
        self.cursor = 0  # position in this epoch's permutation of the next batch's first sequence
        self._order_epoch, self._order_N = -1, torch.empty(0, dtype=torch.int32)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The permutation of sequence indices that epoch `epoch` visits."""
        if epoch != self._order_epoch:
            # Wrapped to 64 bits: manual_seed refuses more, and train.seed may be up to 2**63 - 1.
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**64)
            # int32 where it holds every index: the same permutation as int64 (randperm draws
            # alike in every dtype) in half the memory, ~1 GB less per rank at 10^12 tokens.
            dtype = torch.int32 if len(self.sequences) <= 2**31 else torch.int64
            self._order_N = torch.randperm(len(self.sequences), generator=generator, dtype=dtype)
            self._order_epoch = epoch
        return self._order_N

    def next_batch(self) -> Batch:
        if self.step_size > len(self.sequences):
            indices_B = self._across_epochs()
        else:
            indices_B = self._within_epoch()
        indices = indices_B.tensor_split(self.data_ranks)[self.data_rank].tolist()
        windows_BS1 = self.sequences.gather(indices)
        if self.vocab is not None:
            self.vocab.check(windows_BS1, "training", lambda: self.sequences.id_range(indices))
        return make_batch(windows_BS1, self.eos_id)

    def _within_epoch(self) -> torch.Tensor:
        need = self.step_size if self._step_batch == 0 else self.batch_size
        if self.cursor + need > len(self.sequences):
            self.epoch, self.cursor = self.epoch + 1, 0
        self._step_batch = (self._step_batch + 1) % (self.step_size // self.batch_size)
        indices_B = self.epoch_order(self.epoch)[self.cursor:self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return indices_B

    def _across_epochs(self) -> torch.Tensor:
        """The next B indices of the epochs' orders read back to back: where an epoch ends
        must not depend on B (the micro-batch) when no whole step fits in one."""
        parts = []
        remaining = self.batch_size
        while remaining:
            if self.cursor == len(self.sequences):
                self.epoch, self.cursor = self.epoch + 1, 0
            take = min(remaining, len(self.sequences) - self.cursor)
            parts.append(self.epoch_order(self.epoch)[self.cursor:self.cursor + take])
            self.cursor, remaining = self.cursor + take, remaining - take
        return torch.cat(parts)

    def __iter__(self) -> TrainLoader:
        return self

    def __next__(self) -> Batch:
        return self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        if epoch < 0 or not 0 <= cursor <= len(self.sequences):
            raise DataError(f"data loader state (epoch={epoch}, cursor={cursor}) does not fit "
                            f"the {len(self.sequences)} training sequences; were data.path or "
                            "train.seq_len changed since the checkpoint?")
        self.epoch, self.cursor, self._step_batch = epoch, cursor, 0


def val_batch_rows(num_sequences: int, batch_size: int, num_batches: int,
                   data_ranks: int = 1) -> list[int]:
    """The rows of each batch `val_batches` makes of `num_sequences` validation sequences, over
    all data ranks: what a data rank pads its share to a whole rank's of (`Trainer._val_rows`)."""
    batch_size = min(batch_size, num_sequences)
    count = max(1, min(num_batches, num_sequences // batch_size)) * batch_size  # sequences
    rows = batch_size * data_ranks
    return [min(rows, count - start) for start in range(0, count, rows)]


def val_batches(sequences: PackedSequences, batch_size: int, num_batches: int, eos_id: int, *,
                vocab: Vocabulary | None = None, data_ranks: int = 1,
                data_rank: int | None = None) -> list[Batch]:
    """The first `num_batches` full batches of `batch_size` validation sequences, in stream order,
    grouped `data_ranks` at a time: each batch holds `batch_size` rows for each data rank (the last
    one fewer when `num_batches` is not a multiple), so the sequences validated do not depend on
    the number of data ranks.

    Fewer when the validation set is small (no sequence is counted twice); one smaller batch of
    every sequence when there are fewer than `batch_size`. `vocab`: as for `TrainLoader`.
    `data_rank`: only that rank's rows of each batch, `tensor_split(data_ranks)[data_rank]` (none
    when the batch has fewer rows than ranks), read and checked alone; None: every rank's rows.
    """
    batches, start = [], 0
    for rows in val_batch_rows(len(sequences), batch_size, num_batches, data_ranks):
        indices = range(start, start + rows)
        start += rows
        if data_rank is not None:  # as TrainLoader takes a rank's rows
            indices = torch.arange(indices.start, indices.stop).tensor_split(data_ranks)[data_rank].tolist()
        windows_BS1 = sequences.gather(indices)
        if vocab is not None:
            vocab.check(windows_BS1, "validation", lambda: sequences.id_range(indices))
        batches.append(make_batch(windows_BS1, eos_id))
    return batches
