"""Durable writes: a file written under a temporary name and renamed is on disk, data and name,
once `fsync` has flushed the file before the rename and its directory after it."""

import os
from pathlib import Path


def fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries (a rename into it), to disk. Without it a
    power cut soon after a rename can leave the new name on an empty file: ext4 and XFS may
    write the rename before the data."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
