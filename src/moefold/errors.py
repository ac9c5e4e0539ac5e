"""User-facing errors.

Anything a user can cause (a typo in a config, a missing data file, a corrupt checkpoint) raises a
subclass of `UserError`. The CLI prints its message on one line and exits with status 2, as it does
for a job larger than the machine's memory and for a full or read-only disk (cli.py). An output
that could not be written for the storage's own reason (`OutputError`: EIO, a stale NFS handle) is
one line too, with status 1; everything else is a bug and keeps its traceback.
"""

import contextlib
import errno
import os
import sys
import tempfile
from pathlib import Path

RANK_REPORTS_ENV = "MOEFOLD_RANK_REPORTS"  # set by `moefold train --nproc N` for its ranks


class UserError(Exception):
    """An error caused by the user's input; its message names the option or file and what is allowed."""


class ConfigError(UserError):
    """A config key or value is invalid."""


class DataError(UserError):
    """A data path is missing, empty, unreadable or of an unsupported format."""


class CheckpointError(UserError):
    """A checkpoint or run directory is missing, unreadable or corrupt."""


FULL_OR_READ_ONLY = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
"""Errors writing an output that are the machine's state, the user's to fix: one line, no traceback."""


class OutputError(OSError):
    """Writing an output failed; `filename` is the output the user knows (config.toml, a
    checkpoint), not a temporary file's name or none (a write cut short carries none)."""


@contextlib.contextmanager
def writing(path: Path):
    """An OSError raised inside becomes an OutputError naming `path`."""
    try:
        yield
    except OSError as e:
        raise OutputError(e.errno, e.strerror or str(e), str(path)) from None


class TrainingDiverged(UserError):
    """The gradient norm stopped being finite: the learning rate, warmup or data are the user's to
    change; the checkpoints saved before stay as they were."""


def refuse_unwritable_dir(path: Path, option: str = "--run-dir", given: Path | None = None) -> None:
    """A directory `option` names (to create, or existing) that this process could not write into,
    refused before any work: the commands create their output directories only when they write.
    Tried, not inferred from permission bits: root passes `os.access` everywhere, yet cannot
    create in /proc or on a read-only mount. `given`: what the user typed, where `path` is the
    directory of a file the option names."""
    given = path if given is None else given
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise UserError(f"{option} {given}: {existing} is a file, not a directory")
    try:
        probe = tempfile.mkdtemp(prefix=".moefold-write-check-", dir=existing)
    except OSError as e:
        raise UserError(f"{option} {given}: cannot create anything in {existing} ({e.strerror})") from None
    os.rmdir(probe)


def report(line: str) -> None:
    """Say the line a command ends with (its error, or why training stopped) on stderr. A rank of
    `moefold train --nproc N` leaves it in the launcher's folder instead: the launcher says each
    distinct line once, not once a rank (parallel/launch.py)."""
    folder = os.environ.get(RANK_REPORTS_ENV)
    if folder is not None:
        try:
            with open(Path(folder) / f"rank{os.environ.get('RANK', '0')}", "a", encoding="utf-8") as f:
                f.write(line + "\n")
            return
        except OSError:
            pass  # the launcher is gone, or the disk is full: say it here
    print(line, file=sys.stderr)
