"""One writer at a time in a run directory: a training, or a conversion into it (`moefold convert
--from-hf`).

A training's rank 0 holds an advisory lock (`flock`) on `<run_dir>/.lock` from the moment it writes
into the run directory until `fit` returns; a conversion holds it while it writes. The kernel
releases it when the process ends, however it ends (a kill included), so there is never a stale
lock to clear by hand; the file itself names the holder for the error a second writer gets.
"""

import errno
import fcntl
import os
import socket
from pathlib import Path

from moefold.errors import ConfigError

LOCK_FILE = ".lock"
_HELD = (errno.EWOULDBLOCK, errno.EAGAIN)
TRAINING, CONVERSION = "training", "conversion"
"""What holds a lock, as the lock file records it and a refusal names it."""


class RunDirLock:
    def __init__(self, run_dir: Path, option: str = "--run-dir", work: str = TRAINING):
        """`option`: the command's option naming `run_dir`; `work`: what this process does there."""
        self.run_dir, self.option, self.work = Path(run_dir), option, work
        self._file = None  # open while held; closing it (or the process ending) releases the lock

    def acquire(self) -> None:
        """Hold the lock, or raise ConfigError naming the training or conversion that holds it."""
        if (self.run_dir / LOCK_FILE).is_dir():  # a training refuses it earlier (refuse_run_dir); a conversion here
            raise ConfigError(f"{self.option} {self.run_dir}: {LOCK_FILE} is a directory, where a run keeps its lock "
                              f"file; move it away, or choose another {self.option}")
        f = open(self.run_dir / LOCK_FILE, "ab+")
        if not _try_lock(f, self.run_dir, self.option, self.work, fcntl.LOCK_EX):
            return  # a filesystem without flock: unguarded, as before the lock
        f.truncate(0)
        f.write(f"{os.getpid()} {socket.gethostname()} {self.work}\n".encode())
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def refuse_run_dir_in_use(run_dir: Path, option: str = "--run-dir", work: str = TRAINING) -> None:
    """Refuse a run directory another training or conversion holds, before any work (tried and let
    go at once; the lock itself is taken when the trainer first writes). Shared: every rank of a
    job checks at about the same moment, and exclusive checks at once refused each other."""
    try:
        f = open(Path(run_dir) / LOCK_FILE, "rb")
    except OSError:  # no lock file, nobody ever locked here (or no such run directory yet)
        return
    with f:
        _try_lock(f, run_dir, option, work, fcntl.LOCK_SH)


def _try_lock(f, run_dir: Path, option: str, work: str, mode: int) -> bool:
    """Lock `f` in `mode` (LOCK_EX, LOCK_SH); False where the filesystem has no flock (Lustre
    mounted without it)."""
    try:
        fcntl.flock(f.fileno(), mode | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno not in _HELD:
            f.close()
            return False
        holder = os.pread(f.fileno(), 256, 0).decode(errors="replace").split()
        f.close()
        by = f" (process {holder[0]} on {holder[1]})" if len(holder) >= 2 else ""
        held_for = holder[2] if len(holder) >= 3 else TRAINING  # a file from before conversions locked
        which = "another" if held_for == work else "a"
        raise ConfigError(f"{option} {run_dir} is in use by {which} {held_for}{by}; wait for it to end, "
                          f"or choose another {option}") from None
