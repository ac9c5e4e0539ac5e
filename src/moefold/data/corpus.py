"""Training data as two flat token streams, train and validation.

Text documents are tokenized, each followed by the end-of-document (EOS) token, and concatenated.
The held-out documents are chosen by a hash of each document's name: the split is the same for
every seed, run and machine; identical documents under two names may fall on both sides
(deduplicating is preprocessing). Pre-tokenized files already are a stream; their last
`data.val_fraction` of tokens is held out. Token files are used in place, never copied into
memory: one stream by their offsets (`ConcatenatedTokens`, which reads each window's slices with
positioned reads; one file too). They are joined
as they are, with no EOS inserted between files: their writers already mark documents
(Megatron's preprocess_data with append-EOD ends each with EOD, llm.c's shards start each with
<|endoftext|>), an inserted one would double those, and `data.eos_id` defaults to the
tokenizer's, which need not be the files' (the byte-level 256 is a real GPT-2 id).

The ranks of a run tokenize a text corpus once between them: each reads every document (names and
sizes make the split and the batches) but encodes only every world-th batch, and the ranks then
exchange the ids over a gloo group, each batch's broadcast by its encoder straight into its place
in every rank's streams. The streams are byte for byte those of one process.
"""

from __future__ import annotations

import itertools
import sys
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moefold.config import DataConfig
from moefold.data.formats import (DataFile, DataSearch, Document, read_documents, search_data_path,
                                  stdlib_files)
from moefold.data.loader import Vocabulary
from moefold.data.token_files import ConcatenatedTokens, HeadIds, TokenFile, open_token_file
from moefold.data.tokenizer import Tokenizer
from moefold.errors import DataError

_HASH_BUCKETS = 10_000
_ENCODE_BATCH = 1024  # documents per tokenizer call (HF tokenizers parallelise within a batch)
_ENCODE_CHARS = 1 << 20  # ... or fewer, once they hold this many characters
_VOCAB_CHECK_TOKENS = 1 << 20  # ids checked per token file at startup: catches a wrong tokenizer
# ... and in all token files, yet at least _MIN_CHECK_TOKENS a file: 65k uint16 shards' 1M-id
# heads were 128 GiB read by every rank at startup.
_STARTUP_CHECK_TOKENS = 1 << 26
_MIN_CHECK_TOKENS = 4096


@dataclass
class TokenStreams:
    train_N: np.ndarray | ConcatenatedTokens
    """A view of the token files (one or several), or an array (text)."""
    val_N: np.ndarray | ConcatenatedTokens
    """Empty when data.val_fraction is 0."""
    eos_id: int
    """The end-of-document id separating documents in both streams."""
    vocab: Vocabulary
    """The ids the model embeds, for the loaders to check every batch against."""
    source: str
    """Human description, e.g. "python3.11 stdlib: 1790 files, 31.5 MB"."""
    train_docs: int | None
    """Documents in train_N; None for token files (counting them would read them whole)."""
    val_docs: int | None


def build_token_streams(data_cfg: DataConfig, tokenizer: Tokenizer, *, vocab_size: int | None = None,
                        group: dist.ProcessGroup | None = None) -> TokenStreams:
    """The train and validation token streams of `data.path` (empty: the stdlib corpus).

    `vocab_size` bounds the ids (default: the tokenizer's); pass model.vocab_size when it is set
    larger than the tokenizer's. `group`: a gloo group of every rank building these streams, which
    call this together and share the encoding of a text corpus; None: this process encodes it all.
    """
    if data_cfg.path:
        search, label = search_data_path(data_cfg.path), data_cfg.path
    else:
        search = DataSearch(stdlib_files(), {})
        label = f"python{sys.version_info[0]}.{sys.version_info[1]} stdlib"
    files = search.files
    vocab = Vocabulary(vocab_size or tokenizer.vocab_size, tokenizer.name, label)
    if files[0].is_tokens:
        streams = _token_file_streams(files, label, data_cfg, tokenizer, vocab)
    elif data_cfg.eos_id >= 0:  # refused rather than ignored: text takes the tokenizer's EOS
        raise DataError(f"data.eos_id={data_cfg.eos_id}: applies only to token files (.npy, .bin), "
                        f"but data.path={label} is text, whose documents end with the EOS of "
                        f"tokenizer {tokenizer.name} ({tokenizer.eos_id}); leave data.eos_id at -1")
    else:
        streams = _text_streams(files, label, data_cfg, tokenizer, vocab, group)
    streams.source += search.skipped_note()
    return streams


def stream_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type holding every id below `vocab_size`."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


# ---------------------------------------------------------------------------------------------
# Text documents
# ---------------------------------------------------------------------------------------------


def _text_streams(files: list[DataFile], label: str, cfg: DataConfig, tokenizer: Tokenizer,
                  vocab: Vocabulary, group: dist.ProcessGroup | None) -> TokenStreams:
    threshold = validation_threshold(cfg.val_fraction)
    documents = itertools.chain.from_iterable(read_documents(f, cfg.text_field) for f in files)
    batches = _batched(documents, _ENCODE_BATCH, _ENCODE_CHARS)
    if group is None or dist.get_world_size(group) == 1:
        train, val = _encode_alone(batches, label, threshold, tokenizer)
    else:
        train, val = _encode_shared(batches, label, threshold, tokenizer, group)
    if threshold > 0:
        train_N, val_N, counts = _split_both_nonempty(train, val, label, cfg.val_fraction)
    else:
        train_N, val_N, counts = train.array(), val.array(), (train.docs, val.docs)
    megabytes = sum(f.size for f in files) / 1e6
    return TokenStreams(train_N=train_N, val_N=val_N, eos_id=tokenizer.eos_id, vocab=vocab,
                        source=f"{label}: {_count(len(files), 'file')}, {megabytes:.1f} MB",
                        train_docs=counts[0], val_docs=counts[1])


def _encode_alone(batches: Iterable[list[Document]], label: str, threshold: int,
                  tokenizer: Tokenizer) -> tuple[_TokenBuffer, _TokenBuffer]:
    """The train and validation documents' ids, every batch encoded here."""
    # Each document's ids go straight into its side's growing array: a list of per-document
    # arrays joined at the end held the corpus' ids twice (2.3x their bytes at the peak).
    dtype = stream_dtype(tokenizer.vocab_size)
    train, val = _TokenBuffer(dtype), _TokenBuffer(dtype)
    for batch in batches:
        ids_per_doc = _encode_documents(tokenizer, batch, label)
        _check_encoded_ids(ids_per_doc, tokenizer, batch)
        for doc, ids_N in zip(batch, ids_per_doc):
            held_out = is_validation(doc.name, threshold)
            (val if held_out else train).append(ids_N, tokenizer.eos_id)
    return train, val


class _TokenBuffer:
    """Documents' ids, each followed by EOS, appended in place to one array that grows by an
    eighth: ndarray.resize reallocates, which for a large array remaps its pages rather than
    copying them, so the ids are never held twice."""

    def __init__(self, dtype: np.dtype):
        self._ids_N = np.empty(0, dtype)
        self.size = 0
        self.docs = 0
        self.first_end = 0  # where the first document (with its EOS) ends
        self.last_start = 0  # where the last document starts

    def append(self, ids_N: np.ndarray, eos_id: int) -> None:
        end = self.size + len(ids_N) + 1
        if end > len(self._ids_N):
            capacity = max(end, len(self._ids_N) + len(self._ids_N) // 8, 1 << 12)
            self._ids_N.resize(capacity, refcheck=False)  # no view of it is kept
        self._ids_N[self.size:end - 1] = ids_N
        self._ids_N[end - 1] = eos_id
        self.first_end = self.first_end or end
        self.last_start, self.size, self.docs = self.size, end, self.docs + 1

    def array(self) -> np.ndarray:
        """The ids appended (the spare capacity given back); append no more after."""
        self._ids_N.resize(self.size, refcheck=False)
        return self._ids_N

    @classmethod
    def filled(cls, ids_N: np.ndarray, docs: int, first_end: int, last_start: int) -> _TokenBuffer:
        """A buffer holding `ids_N`, `docs` documents, as if appended one by one."""
        buffer = cls(ids_N.dtype)
        buffer._ids_N, buffer.size, buffer.docs = ids_N, len(ids_N), docs
        buffer.first_end, buffer.last_start = first_end, last_start
        return buffer


@dataclass
class _Piece:
    """One batch's documents of one side (train or validation) in the buffer of the rank that
    encoded them: where they lie, and what `_split_both_nonempty` reads of them."""

    start: int
    size: int = 0
    docs: int = 0
    first_end: int = 0  # where the piece's first document ends, from `start`
    last_start: int = 0  # where its last document starts, from `start`


def _append_batch(sides: tuple[_TokenBuffer, _TokenBuffer], batch: list[Document],
                  ids_per_doc: list[np.ndarray], threshold: int, eos_id: int) -> tuple[_Piece, _Piece]:
    """The batch's documents appended to their sides (train, validation); the two pieces they made."""
    pieces = (_Piece(sides[0].size), _Piece(sides[1].size))
    for doc, ids_N in zip(batch, ids_per_doc):
        side = int(is_validation(doc.name, threshold))
        sides[side].append(ids_N, eos_id)
        piece = pieces[side]
        piece.size, piece.docs = sides[side].size - piece.start, piece.docs + 1
        piece.first_end = piece.first_end or piece.size
        piece.last_start = sides[side].last_start - piece.start
    return pieces


def _encode_shared(batches: Iterable[list[Document]], label: str, threshold: int, tokenizer: Tokenizer,
                   group: dist.ProcessGroup) -> tuple[_TokenBuffer, _TokenBuffer]:
    """`_encode_alone`'s buffers, this rank encoding batches rank, rank + world, ... of `group`'s
    ranks, which all call this: then every rank holds every batch's ids, in batch order. The
    DataError of the first batch that fails on any rank (reading or encoding it, as one process
    would meet it first) is raised on every rank. Any other exception (a fault: the tokenizer's,
    out of memory) is raised where it happened and said to the other ranks, which raise too rather
    than wait for it in the exchange."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dtype = stream_dtype(tokenizer.vocab_size)
    mine = (_TokenBuffer(dtype), _TokenBuffer(dtype))  # this rank's batches: train, validation
    pieces: list[tuple[int, _Piece, _Piece]] = []  # (batch, train piece, validation piece)
    failure, fault, position = None, None, 0
    try:
        for batch in batches:  # every rank reads every document: a read error is met by all
            if position % world == rank:
                ids_per_doc = _encode_documents(tokenizer, batch, label)
                _check_encoded_ids(ids_per_doc, tokenizer, batch)
                pair = _append_batch(mine, batch, ids_per_doc, threshold, tokenizer.eos_id)
                pieces.append((position, *pair))
            position += 1
    except DataError as e:  # the batch being read or encoded; the others go on to the exchange
        failure = (position, e)
    except Exception as e:  # noqa: BLE001 (re-raised below, after the other ranks are told)
        fault = e
        failure = (position, RuntimeError(f"rank {rank} of the ranks encoding {label} failed at its batch "
                                          f"{position}: {type(e).__name__}: {e}"))
    reports: list[Any] = [None] * world
    dist.all_gather_object(reports, (failure, pieces), group=group)
    if fault is not None:
        raise fault
    failures = [failure for failure, _ in reports if failure is not None]
    if failures:
        raise min(failures, key=lambda failure: failure[0])[1]
    owned = sorted((batch, owner, pair) for owner, (_, rank_pieces) in enumerate(reports)
                   for batch, *pair in rank_pieces)
    return tuple(_exchanged_side([(owner, pair[side]) for _, owner, pair in owned], mine[side].array(),
                                 rank, group) for side in (0, 1))


def _exchanged_side(pieces: list[tuple[int, _Piece]], mine_N: np.ndarray, rank: int,
                    group: dist.ProcessGroup) -> _TokenBuffer:
    """One side's stream from its pieces in batch order (owner: the rank that holds it in `mine_N`),
    each broadcast by its owner into its place in every rank's array, so no rank needs a buffer to
    receive into: a rank holds the whole stream and, until it returns, its own share once more."""
    ids_N = np.empty(sum(piece.size for _, piece in pieces), mine_N.dtype)
    works, offset, docs, first_end, last_start = [], 0, 0, 0, 0
    for owner, piece in pieces:
        if not piece.docs:
            continue
        place_N = ids_N[offset:offset + piece.size]
        if owner == rank:
            place_N[:] = mine_N[piece.start:piece.start + piece.size]
        # As bytes: gloo has no uint16 or uint32.
        works.append(dist.broadcast(torch.from_numpy(place_N.view(np.uint8)), group=group, async_op=True,
                                    src=dist.get_global_rank(group, owner)))
        first_end = first_end or offset + piece.first_end
        last_start, docs, offset = offset + piece.last_start, docs + piece.docs, offset + piece.size
    for work in works:
        work.wait()
    return _TokenBuffer.filled(ids_N, docs, first_end, last_start)


def stream_fingerprint(tokens_N: np.ndarray | ConcatenatedTokens, samples: int = 8,
                       width: int = 4096) -> int:
    """A CRC-32 of `samples` evenly spaced runs of `width` ids (the whole stream when shorter):
    what tells a resume that its training data are the checkpoint's when their sizes agree. Reads
    at most samples · width ids, whatever the stream's size."""
    length = len(tokens_N)
    starts = np.linspace(0, max(length - width, 0), samples).astype(np.int64)
    crc = 0
    for start in dict.fromkeys(starts.tolist()):  # a short stream's runs coincide: each read once
        ids_P = np.asarray(tokens_N[start:start + width]).astype(np.int64)  # int64: dtype-independent
        crc = zlib.crc32(ids_P.tobytes(), crc)
    return crc


def validation_threshold(val_fraction: float) -> int:
    """Hash buckets (of 10_000) held out; at least one whenever val_fraction > 0."""
    return max(1, round(val_fraction * _HASH_BUCKETS)) if val_fraction > 0 else 0


def is_validation(name: str, threshold: int) -> bool:
    """Whether the document `name` is held out: its hash bucket is below `threshold` / 10_000."""
    # surrogateescape: a file name that is not UTF-8 (Latin-1 bytes on Linux) reaches us with its
    # bytes escaped as lone surrogates; they hash as those bytes rather than failing the encode.
    return zlib.crc32(name.encode("utf-8", "surrogateescape")) % _HASH_BUCKETS < threshold


def _split_both_nonempty(train: _TokenBuffer, val: _TokenBuffer, label: str, val_fraction: float
                         ) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
    """The train and validation ids and document counts, neither side empty: with few documents
    the hash can leave a side empty; one document moves rather than fail."""
    if train.docs + val.docs == 1:  # one .txt file (input.txt): as a token file splits
        return _split_tail((train if train.docs else val).array(), label, val_fraction)
    if not val.docs:  # the last document
        ids_N, cut = train.array(), train.last_start
        return ids_N[:cut], ids_N[cut:], (train.docs - 1, 1)
    if not train.docs:  # the first document
        ids_N, cut = val.array(), val.first_end
        return ids_N[:cut], ids_N[cut:], (1, val.docs - 1)
    return train.array(), val.array(), (train.docs, val.docs)


def _split_tail(ids_N: np.ndarray, label: str, val_fraction: float
                ) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
    """The one document's last val_fraction of tokens held out for validation."""
    num_val = round(len(ids_N) * val_fraction)
    if not 0 < num_val < len(ids_N):
        raise DataError(f"data.path={label}: one document of {len(ids_N)} tokens cannot be split "
                        f"into train and validation at data.val_fraction={val_fraction}; add text "
                        "or set data.val_fraction=0")
    return ids_N[:-num_val], ids_N[-num_val:], (1, 1)


def _encode_documents(tokenizer: Tokenizer, batch: list[Document], label: str) -> list[np.ndarray]:
    """The ids of each document; text the tokenizer refuses (a DataError) is named by the first
    document it refuses alone."""
    try:
        return _encode_batch(tokenizer, [doc.text for doc in batch])
    except DataError as batch_error:
        for doc in batch:
            try:
                _encode_batch(tokenizer, [doc.text])
            except DataError as e:
                raise DataError(f"data.path={label}: {doc.name}: {e}") from None
        raise batch_error


def _encode_batch(tokenizer: Tokenizer, texts: Sequence[str]) -> list[np.ndarray]:
    batch_encode = getattr(tokenizer, "encode_batch_np", None)
    if batch_encode is not None:
        return batch_encode(texts)
    return [np.asarray(tokenizer.encode(text), dtype=np.int64) for text in texts]


def _check_encoded_ids(ids_per_doc: list[np.ndarray], tokenizer: Tokenizer,
                       batch: list[Document]) -> None:
    """Every id lies in [0, tokenizer.vocab_size): the stream's dtype is sized by it, and a larger
    id would be stored wrapped, as another token, past every later check. Document by document:
    one int64 copy of a batch of long documents was 4x their ids in the stream."""
    eos = tokenizer.eos_id
    low = min([eos, *(int(ids_N.min()) for ids_N in ids_per_doc if ids_N.size)])
    high = max([eos, *(int(ids_N.max()) for ids_N in ids_per_doc if ids_N.size)])
    if low >= 0 and high < tokenizer.vocab_size:
        return
    bad = low if low < 0 else high
    name = next((doc.name for doc, ids in zip(batch, ids_per_doc) if bad in ids), "its EOS")
    raise DataError(f"tokenizer {tokenizer.name} gave id {bad} ({name}), outside its "
                    f"vocabulary [0, {tokenizer.vocab_size}) (its vocab_size)")


def _count(n: int, noun: str) -> str:
    """'1 file', '2 files': the source line reads as English."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _batched(documents: Iterable[Document], n: int, chars: int) -> Iterator[list[Document]]:
    """Up to `n` documents at a time, fewer once they hold `chars` characters: a batch's int64
    ids are transient, so they are bounded in size, not only in count."""
    batch: list[Document] = []
    batch_chars = 0
    for document in documents:
        batch.append(document)
        batch_chars += len(document.text)
        if len(batch) == n or batch_chars >= chars:
            yield batch
            batch, batch_chars = [], 0
    if batch:
        yield batch


# ---------------------------------------------------------------------------------------------
# Token files
# ---------------------------------------------------------------------------------------------


def _token_file_streams(files: list[DataFile], label: str, cfg: DataConfig,
                        tokenizer: Tokenizer, vocab: Vocabulary) -> TokenStreams:
    eos_id = cfg.eos_id if cfg.eos_id >= 0 else tokenizer.eos_id
    if eos_id >= vocab.size:
        raise DataError(f"data.eos_id={eos_id} is not below the vocabulary size {vocab.size} "
                        f"of tokenizer {tokenizer.name} (data.tokenizer)")
    head_tokens = min(_VOCAB_CHECK_TOKENS,
                      max(_MIN_CHECK_TOKENS, _STARTUP_CHECK_TOKENS // len(files)))
    token_files = [_checked_token_file(f, cfg.token_dtype, vocab, head_tokens) for f in files]
    # Never copied: the files are one stream by their offsets, each read with pread while open
    # (a bounded number at once: `ulimit -n` caps a process's descriptors). One file too: its
    # memory map would fault (SIGBUS) on a read past an end cut shorter under the run.
    tokens_N = ConcatenatedTokens.of(token_files)
    num_val = round(len(tokens_N) * cfg.val_fraction)
    if cfg.val_fraction > 0 and num_val == 0:
        raise DataError(f"data.path={label}: {len(tokens_N)} tokens leave no validation tokens "
                        f"at data.val_fraction={cfg.val_fraction}")
    if num_val >= len(tokens_N):
        raise DataError(f"data.path={label}: {len(tokens_N)} tokens leave no training tokens "
                        f"at data.val_fraction={cfg.val_fraction}")
    split = len(tokens_N) - num_val
    source = f"{label}: {_count(len(files), 'token file')}, {len(tokens_N) / 1e6:.1f}M tokens"
    return TokenStreams(train_N=tokens_N[:split], val_N=tokens_N[split:], eos_id=eos_id,
                        vocab=vocab, source=source, train_docs=None, val_docs=None)


def _checked_token_file(file: DataFile, token_dtype: str, vocab: Vocabulary,
                        head_tokens: int) -> TokenFile:
    """Where the file's ids lie, its first `head_tokens` checked; its descriptor closes on return,
    so startup holds one file open at a time."""
    layout, head = open_token_file(file, token_dtype, head_tokens)
    _check_token_ids(file, head, vocab)
    return layout


def _check_token_ids(file: DataFile, head: HeadIds, vocab: Vocabulary) -> None:
    """Ids in the file's head (~1M tokens; fewer in a corpus of more than 64 files) lie in
    [0, vocab.size): reading it whole is too slow. A wrong tokenizer shows at once; a stray id
    later fails its batch (Vocabulary.check)."""
    if head.low < 0 or head.high >= vocab.size:
        bad = head.low if head.low < 0 else head.high
        raise file.error(f"token id {bad} is outside the vocabulary [0, {vocab.size}) of "
                         f"tokenizer {vocab.tokenizer}; set data.tokenizer to the tokenizer that "
                         "produced the file")
