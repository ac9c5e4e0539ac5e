"""Finding training data on disk (the embedded corpus, text files, token files) and reading text.

Text files (.txt, .jsonl, .parquet) are read as a stream of named `Document`s; a document's name
is relative to `data.path`, so the validation split does not move when the data does. Token files
(.npy, .bin) are opened by token_files.py. Anything wrong with the input is a one-line
`DataError` naming `data.path`, the file and what is allowed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import sysconfig
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from moefold.errors import DataError

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
TOKEN_SUFFIXES = (".npy", ".bin")
SUFFIXES = TEXT_SUFFIXES + TOKEN_SUFFIXES
ALLOWED = ".txt, .jsonl, .parquet, .npy or .bin"
_THIRD_PARTY_DIRS = ("site-packages", "dist-packages")
_COMPRESSED = (".gz", ".zst", ".bz2", ".xz", ".zip", ".lz4")
_UTF8_BOM = b"\xef\xbb\xbf"
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads joins the valid pairs


@dataclass(frozen=True)
class Document:
    name: str
    """Stable across machines and runs: it decides whether the document is held out."""
    text: str


@dataclass(frozen=True)
class DataFile:
    path: Path
    name: str
    """Path relative to `root` (the file name when `data.path` is the file itself)."""
    root: str
    """What the user gave as `data.path` (or the stdlib directory), for messages."""
    size: int

    @property
    def suffix(self) -> str:
        return self.path.suffix.lower()

    @property
    def is_tokens(self) -> bool:
        return self.suffix in TOKEN_SUFFIXES

    def error(self, message: str) -> DataError:
        where = "" if Path(self.root) == self.path else f"{self.name}: "
        return DataError(f"data.path={self.root}: {where}{message}")


# ---------------------------------------------------------------------------------------------
# Locating files
# ---------------------------------------------------------------------------------------------


def stdlib_files() -> list[DataFile]:
    """The running Python's nonempty standard-library .py sources, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _THIRD_PARTY_DIRS]
        for filename in filenames:
            if filename.endswith(".py"):
                path = Path(dirpath, filename)
                files.append(DataFile(path, path.relative_to(root).as_posix(), str(root),
                                      path.stat().st_size))
    files = [f for f in files if f.size > 0]  # empty __init__.py files are no documents
    if not files:
        raise DataError(f"data.path is empty, but the embedded corpus has no .py files under "
                        f"{root}; set data.path to your training data")
    return sorted(files, key=lambda f: f.name)


@dataclass(frozen=True)
class DataSearch:
    files: list[DataFile]
    """The files read, sorted by name."""
    skipped: dict[str, int]
    """Files under a data.path directory of types the loader does not read: count per type."""

    def skipped_note(self) -> str:
        """'' or "; skipped 3 files of types the loader does not read (2 .json.gz, 1 .md)"."""
        if not self.skipped:
            return ""
        count = sum(self.skipped.values())
        return (f"; skipped {count} file{'' if count == 1 else 's'} of types the loader does not "
                f"read ({_kinds(self.skipped)})")


def find_data_files(data_path: str) -> list[DataFile]:
    """The data files `data.path` names (a file, or a directory searched recursively), sorted."""
    return search_data_path(data_path).files


def search_data_path(data_path: str) -> DataSearch:
    """`find_data_files`, with the count of the files passed over (said on the source line: a
    directory of .json.gz shards beside one .txt would otherwise train on the .txt alone)."""
    root = Path(data_path)
    try:
        search = _locate_files(root, data_path)
    except OSError as e:  # stat under a directory without search (x) permission: EACCES
        raise _unreadable(e, root, data_path) from None
    for file in search.files:
        _check_file(file)
    if len({file.is_tokens for file in search.files}) > 1:
        raise DataError(f"data.path={data_path}: mixes text files (.txt, .jsonl, .parquet) with "
                        "token files (.npy, .bin); point data.path at one kind")
    return search


def _locate_files(root: Path, data_path: str) -> DataSearch:
    if not root.exists():
        raise DataError(f"data.path={data_path}: no such file or directory")
    if not root.is_dir():
        return DataSearch([_data_file(root, root.name, data_path)], {})
    # Not filtered by is_file(): a broken symlink to a data file is an error, not less data.
    walked = _walk_files(root, data_path)
    paths = [p for p in walked if p.suffix.lower() in SUFFIXES]
    skipped = Counter(_kind(p) for p in walked if p.suffix.lower() not in SUFFIXES)
    if not paths:
        raise DataError(f"data.path={data_path}: no {ALLOWED} files found ({_found(skipped)})")
    files = sorted((_data_file(p, p.relative_to(root).as_posix(), data_path) for p in paths),
                   key=lambda f: f.name)
    return DataSearch(_first_of_each_file(files), dict(skipped))


def _kind(path: Path) -> str:
    """A file's type as a user names it: .json.gz for a compressed shard, not .gz."""
    suffixes = path.suffixes[-2:] if path.suffix.lower() in _COMPRESSED else path.suffixes[-1:]
    return "".join(suffixes).lower() or "(no suffix)"


def _kinds(counts: dict[str, int]) -> str:
    """'3 .json.gz, 1 .md': the most frequent first, ties by name (not walk order)."""
    return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items(),
                                                         key=lambda item: (-item[1], item[0])))


def _found(skipped: Counter) -> str:
    if not skipped:
        return "found no files; hidden ones (.name) are not data"
    compressed = any(Path(kind).suffix in _COMPRESSED for kind in skipped)
    return f"found {_kinds(skipped)}" + ("; decompress them" if compressed else "")


def _first_of_each_file(files: list[DataFile]) -> list[DataFile]:
    """One entry per file on disk, the first name of each: a symlink (b.txt -> a.txt) or a hard
    link to a file already read would give its documents double weight."""
    seen: set[object] = set()
    unique = []
    for file in files:
        status = file.path.stat()
        # (st_dev, st_ino) names a file whatever links reach it; a file system without inode
        # numbers (0) falls back to the resolved path.
        key = (status.st_dev, status.st_ino) if status.st_ino else os.path.realpath(file.path)
        if key not in seen:
            seen.add(key)
            unique.append(file)
    return unique


def _unreadable(e: OSError, root: Path, data_path: str) -> DataError:
    """The one-line error for an OSError listing or stat-ing `e.filename` under data.path."""
    where = ""
    if e.filename and Path(e.filename) != root:
        where = Path(e.filename).relative_to(root).as_posix() + ": "
    return DataError(f"data.path={data_path}: {where}cannot be read ({e.strerror or e})")


def _walk_files(root: Path, data_path: str) -> list[Path]:
    """Every file under `root` but hidden ones (.name), through symlinked directories too
    (Path.rglob does not follow them). A directory reached again (a symlink loop, a second link)
    is walked once, by the first path in sorted order. One that cannot be listed is an error:
    os.walk skips it silently."""

    def unreadable(e: OSError) -> None:
        raise _unreadable(e, root, data_path)

    seen: set[str] = set()
    paths = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True, onerror=unreadable):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames.clear()
            continue
        seen.add(real)
        # Hidden entries are no data (what `ls` shows trains, as in Hugging Face datasets): a
        # Jupyter .ipynb_checkpoints copy, macOS's AppleDouble ._a.txt metadata.
        # Sorted: os.walk visits in this order, so which alias wins is deterministic.
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        paths += [Path(dirpath, filename) for filename in filenames if not filename.startswith(".")]
    return paths


def _data_file(path: Path, name: str, root: str) -> DataFile:
    try:
        status = path.stat()
    except OSError as e:  # the caller names any other file that cannot be stat'ed
        if not path.is_symlink():
            raise
        raise DataFile(path, name, root, 0).error(
            f"a symlink to {os.readlink(path)}, which cannot be read ({e.strerror or e})") from None
    if not stat.S_ISREG(status.st_mode):  # a FIFO or device named x.txt: reading would hang
        raise DataFile(path, name, root, 0).error("not a regular file")
    return DataFile(path, name, root, status.st_size)


def _check_file(file: DataFile) -> None:
    if file.suffix not in SUFFIXES:
        raise file.error(f"unsupported file type {file.suffix or '(no suffix)'} "
                         f"(allowed: {ALLOWED})")
    if file.size == 0:
        raise file.error("empty file")


# ---------------------------------------------------------------------------------------------
# Text files → documents
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def reading(file: DataFile) -> Iterator[None]:
    """An OSError reading `file` (permission denied, an I/O error) is the one-line DataError
    naming it that errors.py promises for an unreadable data path, not a traceback."""
    try:
        yield
    except OSError as e:
        raise file.error(f"cannot be read ({e.strerror or e})") from None


def read_documents(file: DataFile, text_field: str) -> Iterator[Document]:
    """The documents of one text file, in file order; empty and null texts are skipped."""
    reader = _READERS.get(file.suffix, _whole_file_document)
    count = 0
    with reading(file):
        for document in reader(file, text_field):
            count += 1
            yield document
    if count == 0 and file.suffix == ".txt":  # not empty (checked), so only a byte-order mark
        raise file.error("no documents (only a UTF-8 byte-order mark)")
    if count == 0:
        raise file.error(f"no documents (every record is blank or has an empty or null "
                         f"data.text_field={text_field!r})")


def _whole_file_document(file: DataFile, text_field: str) -> Iterator[Document]:
    raw = file.path.read_bytes()
    _refuse_utf16(file, raw)
    # Undecodable bytes become U+FFFD rather than failing a whole corpus over one stray byte; a
    # leading UTF-8 byte-order mark (Windows Notepad writes one) is no text, as in .jsonl files.
    text = raw.decode("utf-8-sig", errors="replace")
    del raw  # not held beside its text while the document is tokenized (a generator's frame)
    if text:
        yield Document(file.name, text)


def _refuse_utf16(file: DataFile, head: bytes) -> None:
    """A UTF-16 or UTF-32 byte-order mark (Windows PowerShell 5's `>` writes one): read as UTF-8,
    the text would be U+FFFD and NUL bytes. FF and FE never occur in UTF-8."""
    if head.startswith((b"\xff\xfe", b"\xfe\xff", b"\x00\x00\xfe\xff")):
        raise file.error("UTF-16 or UTF-32 text (it starts with a byte-order mark); save it as "
                         "UTF-8")


def _jsonl_documents(file: DataFile, text_field: str) -> Iterator[Document]:
    with file.path.open("rb") as f:
        for line_no, line in enumerate(f, start=1):
            if line_no == 1:
                _refuse_utf16(file, line)
            if not line.removeprefix(_UTF8_BOM).strip():  # a blank line, BOM or not
                continue
            try:
                # Undecodable bytes become U+FFFD, as in .txt files; a leading BOM is dropped.
                record = json.loads(line.decode("utf-8-sig", errors="replace"))
            except ValueError as e:
                raise file.error(f"line {line_no}: not valid JSON ({e})") from None
            except RecursionError:  # json's decoder recurses once per nested array or object
                raise file.error(f"line {line_no}: JSON nested too deeply to read "
                                 "(one flat object per line)") from None
            if not isinstance(record, dict):  # "no field" would send the user to data.text_field
                raise file.error(f"line {line_no}: a JSON {_json_kind(record)}, not an object "
                                 f"with field {text_field!r} (one object per line)")
            if text_field not in record:
                raise file.error(f"line {line_no}: no field {text_field!r} (data.text_field)")
            text = record[text_field]
            if text is None:  # a null carries no document, as in .parquet
                continue
            if not isinstance(text, str):
                raise file.error(f"line {line_no}: field {text_field!r} is "
                                 f"{type(text).__name__}, not a string")
            if text:
                # JSON may escape a lone surrogate ("\ud800"), which no tokenizer can encode.
                yield Document(f"{file.name}:{line_no}", _LONE_SURROGATE.sub("\ufffd", text))


def _json_kind(value: object) -> str:
    """The JSON type of a parsed non-object value, as JSON names it."""
    if isinstance(value, bool):
        return "boolean"
    kinds = {list: "array", str: "string", int: "number", float: "number", type(None): "null"}
    return kinds[type(value)]


def _parquet_documents(file: DataFile, text_field: str) -> Iterator[Document]:
    pa, pq = _import_pyarrow(file)
    try:
        parquet = pq.ParquetFile(file.path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for corrupt files
        raise file.error(f"not a valid Parquet file ({first_line(e)})") from None
    schema = parquet.schema_arrow
    if text_field not in schema.names:
        raise file.error(f"no column {text_field!r} (data.text_field); columns: "
                         f"{', '.join(schema.names)}")
    column_type = schema.field(text_field).type
    if not _is_text(pa, column_type):
        raise file.error(f"column {text_field!r} is {column_type}, not a string")
    row = 0
    for column in _column_batches(pa, parquet, file, text_field):
        for raw in _utf8_values(pa, column):
            if raw:  # None (null) and "" carry no document
                # Not every writer checks its UTF-8: bad bytes become U+FFFD, as in .txt files.
                yield Document(f"{file.name}:{row}", raw.decode("utf-8", errors="replace"))
            row += 1


def _is_text(pa, column_type) -> bool:
    """Strings in any of Arrow's layouts: plain, large, view (pyarrow >= 16), or dictionary-encoded
    (a pandas category, a Polars Categorical), all read back as Python strings."""
    if pa.types.is_dictionary(column_type):
        column_type = column_type.value_type
    is_view = getattr(pa.types, "is_string_view", lambda _: False)
    return (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)
            or is_view(column_type))


def _column_batches(pa, parquet, file: DataFile, text_field: str) -> Iterator:
    """The column `text_field`, a batch of rows at a time. The footer read fine; a corrupt page
    further on is a one-line DataError too, not pyarrow's traceback."""
    batches = parquet.iter_batches(columns=[text_field], batch_size=4096)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (OSError, pa.ArrowException) as e:
            raise file.error(f"not a valid Parquet file ({first_line(e)})") from None
        yield batch.column(0)


def _utf8_values(pa, column) -> list[bytes | None]:
    """A string column's values as their bytes: to_pylist would raise UnicodeDecodeError (a
    traceback) on the first invalid UTF-8 value."""
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    return column.cast(pa.large_binary()).to_pylist()


def _import_pyarrow(file: DataFile):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise file.error("reading .parquet needs the `pyarrow` package "
                         "(pip install 'moefold[data]')") from None
    return pa, pq


_READERS: dict[str, Callable[[DataFile, str], Iterator[Document]]] = {
    ".jsonl": _jsonl_documents,
    ".parquet": _parquet_documents,
}


def first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
