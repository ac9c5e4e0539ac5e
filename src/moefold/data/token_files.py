"""Token files (.npy, .bin): never read whole; read as one stream, a bounded number of them
held open at once, each slice read with positioned reads (pread), not through a memory map.

A map of a file cut shorter under the run faults (SIGBUS) on the first read past its new end, and
the rank dies without a word; a check of the size before each read still races the truncation. A
positioned read cannot fault: it ends early, and that is a `DataError` naming the file. Startup
still maps each file once to read its header and head (`open_token_file`); a corpus of one file is
a stream of one.

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


def open_token_file(file: DataFile, token_dtype: str, head_tokens: int) -> np.ndarray:
    """A read-only, memory-mapped 1-D array of the file's token ids; a .bin file's width is judged
    on its first `head_tokens` ids."""
    with reading(file):
        tokens_N = (_open_npy(file) if file.suffix == ".npy"
                    else _open_bin(file, token_dtype, head_tokens))
    if tokens_N.size == 0:
        raise file.error("no tokens")
    return tokens_N


def _open_npy(file: DataFile) -> np.ndarray:
    # Checked first: without the magic, np.load would try (and refuse) to unpickle the file.
    with file.path.open("rb") as f:
        if f.read(len(_NPY_MAGIC)) != _NPY_MAGIC:
            raise file.error("not a .npy file (no NumPy header; save with numpy.save)")
    try:
        tokens_N = np.load(file.path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise file.error(f"not a valid .npy file ({first_line(e)})") from None
    # By kind, not np.issubdtype(..., np.integer): NumPy counts timedelta64 as an integer type.
    if tokens_N.ndim != 1 or tokens_N.dtype.kind not in "iu":
        raise file.error(f"expected a 1-D integer array of token ids, got shape "
                         f"{tokens_N.shape} of {tokens_N.dtype}")
    return tokens_N


def _open_bin(file: DataFile, token_dtype: str, head_tokens: int) -> np.ndarray:
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
    tokens_N = np.memmap(file.path, dtype=dtype, mode="r")
    _refuse_uint32_as_uint16(file, tokens_N[:head_tokens])
    return tokens_N


def _refuse_uint32_as_uint16(file: DataFile, head_N: np.ndarray) -> None:
    """uint32 ids (below 65,536, little-endian) read as uint16 are each id followed by a 0: all
    inside the vocabulary, so no id check sees them. Judged on the file's head, the ids corpus.py
    checks, and only from 64 on: a real id 0 at every odd position that long is no text."""
    head_N = np.asarray(head_N)
    if (head_N.dtype == np.uint16 and len(head_N) >= 64 and not head_N[1::2].any()
            and head_N[0::2].any()):
        raise file.error(f"every second uint16 id is 0 in its first {len(head_N)} ids: uint32 "
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

    @classmethod
    def of(cls, file: DataFile, tokens_N: np.memmap) -> TokenFile:
        """The layout of `tokens_N`, `open_token_file(file, ...)`'s map."""
        return cls(file, tokens_N.dtype, tokens_N.offset, len(tokens_N))

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
