"""Token files (.npy, .bin): never read whole; read as one stream, a bounded number of them
held open at once, each slice read with positioned reads (pread), not through a memory map.

A map of a file cut shorter under the run faults (SIGBUS) on the first read past its new end, and
the rank dies without a word; a check of the size before each read still races the truncation. A
positioned read cannot fault: it ends early, and that is a `DataError` naming the file. Startup
reads each file's header and head the same way (`open_token_file`); a corpus of one file is a
stream of one.

Anything wrong with a file is a one-line `DataError` naming `data.path`, the file and what is
allowed. F: files; N: ids of a stream; P: ids of one file's slice.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from moefold.data.formats import DataFile, first_line, reading

_NPY_MAGIC = b"\x93NUMPY"


@dataclass(frozen=True)
class HeadIds:
    """What startup checks of a file's first ids, read in pieces of `HEAD_PIECE_IDS`: a 1M-id head
    of uint64 held whole was 8 MB a file."""

    low: int
    high: int
    count: int


HEAD_PIECE_IDS = 1 << 16  # even: each piece's odd positions are the file's


def open_token_file(file: DataFile, token_dtype: str, head_tokens: int) -> tuple[TokenFile, HeadIds]:
    """Where the file's ids lie (`TokenFile`) and the range of its first `head_tokens` ids, read
    with positioned reads like every later read: no map, so a file cut shorter while the run starts
    is a `DataError`, not a fault. A .bin file's width is judged on those ids."""
    with reading(file):
        layout = _npy_layout(file) if file.suffix == ".npy" else _bin_layout(file, token_dtype)
    if layout.length == 0:
        raise file.error("no tokens")
    low, high, odd_ids_any, even_ids_any = None, None, False, False
    for piece_P in layout.head_pieces(head_tokens):
        low = int(piece_P.min()) if low is None else min(low, int(piece_P.min()))
        high = int(piece_P.max()) if high is None else max(high, int(piece_P.max()))
        odd_ids_any, even_ids_any = odd_ids_any or piece_P[1::2].any(), even_ids_any or piece_P[0::2].any()
    head = HeadIds(low, high, min(head_tokens, layout.length))
    if layout.dtype == np.uint16 and file.suffix != ".npy":
        _refuse_uint32_as_uint16(file, head, odd_ids_any, even_ids_any)
    return layout, head


def _npy_layout(file: DataFile) -> TokenFile:
    # The magic is checked first: np.lib.format would read anything else as a version error.
    with file.path.open("rb") as f:
        if f.read(len(_NPY_MAGIC)) != _NPY_MAGIC:
            raise file.error("not a .npy file (no NumPy header; save with numpy.save)")
        f.seek(0)
        try:
            version = np.lib.format.read_magic(f)
            # Version 3.0 differs from 2.0 only in its header's encoding (UTF-8 field names).
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, _, dtype = read_header(f)
        except (ValueError, OSError, EOFError) as e:
            raise file.error(f"not a valid .npy file ({first_line(e)})") from None
        offset = f.tell()
    # By kind, not np.issubdtype(..., np.integer): NumPy counts timedelta64 as an integer type.
    if len(shape) != 1 or dtype.kind not in "iu":
        raise file.error(f"expected a 1-D integer array of token ids, got shape {shape} of {dtype}")
    if offset + shape[0] * dtype.itemsize > file.size:
        raise file.error(f"not a valid .npy file (its header promises {shape[0]} ids of {dtype}, "
                         f"{file.size - offset} bytes hold fewer)")
    return TokenFile(file, dtype, offset, shape[0])


def _bin_layout(file: DataFile, token_dtype: str) -> TokenFile:
    # A header read as ids would be trained on (and its dtype ignored) wherever the vocabulary
    # holds them: np.save into an open file named x.bin writes one.
    with file.path.open("rb") as f:
        if f.read(len(_NPY_MAGIC)) == _NPY_MAGIC:
            raise file.error("a .npy file (it has a NumPy header), not raw token ids; rename it "
                             "to .npy")
    dtype = np.dtype(token_dtype)
    if file.size % dtype.itemsize:
        raise file.error(f"{file.size} bytes is not a whole number of {token_dtype} tokens "
                         "(check data.token_dtype)")
    return TokenFile(file, dtype, 0, file.size // dtype.itemsize)


def _refuse_uint32_as_uint16(file: DataFile, head: HeadIds, odd_ids_any: bool, even_ids_any: bool) -> None:
    """uint32 ids (below 65,536, little-endian) read as uint16 are each id followed by a 0: all
    inside the vocabulary, so no id check sees them. Judged on the file's head, the ids corpus.py
    checks, and only from 64 on: a real id 0 at every odd position that long is no text."""
    if head.count >= 64 and not odd_ids_any and even_ids_any:
        raise file.error(f"every second uint16 id is 0 in its first {head.count} ids: uint32 "
                         "token ids read as uint16; set data.token_dtype=uint32")


MAX_OPEN_TOKEN_FILES = 128
"""Token files a process holds open at once, a file descriptor each; the others are opened again
when read, the least recently read closed first. `ulimit -n` is often 1,024: a corpus of ~65k
shards, each held open for the whole run, could not start."""


@dataclass(frozen=True)
class TokenFile:
    """Where a token file's ids lie, read when it was opened and checked at startup: what opens
    and reads it again on demand, without its header read or checked again."""

    file: DataFile
    dtype: np.dtype
    offset: int
    """Bytes before the first id: a .npy file's header."""
    length: int
    """Ids in the file."""

    def head_pieces(self, count: int) -> Iterator[np.ndarray]:
        """The first `count` ids (all, in a shorter file), `HEAD_PIECE_IDS` at a time, read through
        a descriptor of their own."""
        count = min(count, self.length)
        descriptor = self.open_descriptor()
        try:
            for start in range(0, count, HEAD_PIECE_IDS):
                piece_P = np.empty(min(HEAD_PIECE_IDS, count - start), dtype=self.dtype)
                self.read_into(descriptor, start, piece_P)
                yield piece_P
        finally:
            os.close(descriptor)

    def open_descriptor(self) -> int:
        """A read-only descriptor of the file, for `read_into`; a file changed since startup is
        refused by name."""
        with reading(self.file):
            descriptor = os.open(self.file.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                size = os.fstat(descriptor).st_size
            except OSError:
                os.close(descriptor)
                raise
        if size != self.file.size:
            os.close(descriptor)
            raise self._changed(size)
        return descriptor

    def read_into(self, descriptor: int, start: int, ids_P: np.ndarray) -> None:
        """Fills `ids_P` (contiguous, of this file's dtype) with the file's ids from `start` on,
        read from `descriptor`. A file cut shorter under the run ends the read early: a DataError
        naming it, where reading a map past the file's end faulted (SIGBUS)."""
        buffer = memoryview(ids_P.view(np.uint8))  # bytes: a big-endian dtype has no buffer format
        position = self.offset + start * self.dtype.itemsize
        done = 0
        while done < len(buffer):  # a regular file reads short only at its end (or > 2 GiB)
            try:
                count = os.preadv(descriptor, [buffer[done:]], position + done)
            except OSError:  # an I/O error, named as reading() names it (a `with` a read: 1 us)
                with reading(self.file):
                    raise
            if count == 0:
                raise self._changed(os.fstat(descriptor).st_size)
            done += count

    def _changed(self, size: int) -> Exception:
        return self.file.error(f"changed since training started ({size} bytes, then "
                               f"{self.file.size}); token files must not change under a run")


class OpenTokenFiles:
    """Token files by index, each opened when read and at most MAX_OPEN_TOKEN_FILES at once: the
    least recently read is closed first."""

    def __init__(self, files: tuple[TokenFile, ...]):
        self.files = files
        self._descriptors_by_file: OrderedDict[int, int] = OrderedDict()
        # A descriptor closed by one thread while another reads it could be reused by the next
        # file opened, and that file's bytes read as this one's.
        self._lock = threading.Lock()

    def read(self, f: int, start: int, stop: int, out_P: np.ndarray | None = None) -> np.ndarray:
        """Ids [start, stop) of file `f` in its own dtype: into `out_P` if given (of that dtype,
        contiguous), else a new array."""
        ids_P = np.empty(max(stop - start, 0), self.files[f].dtype) if out_P is None else out_P
        with self._lock:
            self.files[f].read_into(self._descriptor(f), start, ids_P)
        return ids_P

    def _descriptor(self, f: int) -> int:
        descriptor = self._descriptors_by_file.pop(f, None)
        if descriptor is None:
            open_files = self._descriptors_by_file
            while open_files and len(open_files) >= MAX_OPEN_TOKEN_FILES:
                os.close(open_files.popitem(last=False)[1])
            descriptor = self.files[f].open_descriptor()
        self._descriptors_by_file[f] = descriptor  # now the most recently read
        return descriptor

    def close(self) -> None:
        with self._lock:
            while self._descriptors_by_file:
                os.close(self._descriptors_by_file.popitem()[1])

    def __del__(self) -> None:
        if hasattr(self, "_lock"):  # not after an __init__ that failed
            self.close()

    def __getstate__(self) -> dict:
        # A DataLoader worker or a spawned process gets the files, and opens its own descriptors.
        return {"files": self.files}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["files"])


@dataclass(frozen=True, eq=False)
class ConcatenatedTokens:
    """Token files read as one stream without joining them, as Megatron-Core's indexed datasets do:
    a slice reads only the files it touches, each with positioned reads (a bounded number open at
    once: `OpenTokenFiles`) (F: the files). np.concatenate held the whole stream on every rank:
    20 GB for 10^10 uint16 tokens, 8 per node.

    A slice (step 1) is another such view, as an array's would be, sharing the open files;
    np.asarray reads it."""

    files: OpenTokenFiles
    offsets_F1: np.ndarray
    """File f holds the stream's tokens [offsets_F1[f], offsets_F1[f + 1])."""
    start: int
    stop: int
    dtype: np.dtype

    @classmethod
    def of(cls, files: Sequence[TokenFile]) -> ConcatenatedTokens:
        offsets_F1 = np.cumsum([0, *(f.length for f in files)])
        dtype = np.result_type(*(f.dtype for f in files))
        # uint64 with a signed type promotes to float64 (8 bytes an id, inexact above 2**53); as
        # int64 an id the model cannot hold stays refused: a uint64 one past 2**63 turns negative.
        dtype = dtype if dtype.kind in "iu" else np.dtype(np.int64)
        return cls(OpenTokenFiles(tuple(files)), offsets_F1, 0, int(offsets_F1[-1]), dtype)

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def size(self) -> int:
        return len(self)

    def __getitem__(self, key: slice) -> ConcatenatedTokens:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"token stream index {key!r}: only slices of step 1 are read")
        start, stop, _ = key.indices(len(self))
        return replace(self, start=self.start + start, stop=self.start + max(start, stop))

    def pieces(self) -> Iterator[np.ndarray]:
        """The slices of the files this view spans, in order, each read into a new array in its
        file's own dtype."""
        for f, start, stop in self._spans():
            yield self.files.read(f, start, stop)

    def _spans(self) -> Iterator[tuple[int, int, int]]:
        """(file, its first id read, past its last) for each file this view spans, in order."""
        offsets_F1 = self.offsets_F1
        first = int(np.searchsorted(offsets_F1, self.start, side="right")) - 1
        end = int(np.searchsorted(offsets_F1, self.stop, side="left"))  # past the last file read
        for f in range(first, end):
            file_start, file_stop = int(offsets_F1[f]), int(offsets_F1[f + 1])
            yield f, max(self.start - file_start, 0), min(self.stop, file_stop) - file_start

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        tokens_N = np.empty(len(self), self.dtype)
        at = 0
        for f, start, stop in self._spans():
            out_P = tokens_N[at:at + max(stop - start, 0)]
            if self.files.files[f].dtype == self.dtype:  # read in place, no copy
                self.files.read(f, start, stop, out_P)
            else:  # "unsafe": uint64 ids are read as int64 (see `of`); every other cast is exact.
                np.copyto(out_P, self.files.read(f, start, stop), casting="unsafe")
            at += len(out_P)
        return tokens_N if dtype is None else tokens_N.astype(dtype, copy=False)

    def tolist(self) -> list[int]:
        return np.asarray(self).tolist()
