"""Durable writes: a file written under a temporary name and renamed is on disk, data and name,
once `fsync` has flushed the file before the rename and its directory after it."""

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moefold.errors import writing


def fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries (a rename into it), to disk. Without it a
    power cut soon after a rename can leave the new name on an empty file: ext4 and XFS may
    write the rename before the data."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rename_durably(written: Path, path: Path) -> None:
    """Rename the complete file `written` to `path`: its data on disk before the rename, the
    rename on disk after it."""
    fsync(written)
    os.replace(written, path)
    fsync(path.parent)


def write_atomically(path: Path, write: Callable[[Path], Any]) -> None:
    """`write(tmp)` writes the file, beside `path`; renamed durably, `path` is replaced whole or
    left as it was. A failed write raises an OutputError naming `path` (a write cut short has no
    file name of its own) and leaves no partial copy beside it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with writing(path):
        try:
            write(tmp)
            rename_durably(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)  # renamed already, unless the write failed
