"""Training metrics: expert-load statistics, throughput, and where metrics are written.

Every log step produces one flat dict of plain numbers; sinks write it to the console,
`<run_dir>/metrics.jsonl` (one JSON object per line) and TensorBoard when it is installed.
"""

import contextlib
import json
import math
import os
import resource
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moefold.errors import OutputError, writing
from moefold.files import fsync


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated device memory on a GPU; peak resident host memory of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / (2**30 if sys.platform == "darwin" else 2**20)  # bytes on macOS, KiB on Linux


def throughput(tokens: int, seconds: float, flops_per_token: int, peak_tflops: float | None) -> dict[str, float | None]:
    tokens_per_s = tokens / seconds
    tflops = tokens_per_s * flops_per_token / 1e12
    return {"tokens_per_s": tokens_per_s, "tflops": tflops,
            "mfu": tflops / peak_tflops if peak_tflops else None}


def format_line(m: dict[str, Any], total_steps: int) -> str:
    parts = [f"step {m['step']}/{total_steps}"]
    if "loss" in m:
        parts += [f"loss {m['loss']:.4f}", f"grad_norm {m['grad_norm']:.3f}", f"lr {m['lr']:.2e}",
                  f"{m['tokens_per_s']:,.0f} tok/s", f"{m['tflops']:.3f} TFLOP/s"]
        parts.append(f"mfu {100 * m['mfu']:.1f}%" if m.get("mfu") is not None else "mfu -")
        parts.append(f"mem {m['peak_mem_gib']:.2f} GiB")
    if "aux_loss" in m:
        parts.append(f"aux {m['aux_loss']:.4f}")
    # nan: the window routed no copy (no ratio; null in metrics.jsonl); 0 dropped: dropless
    if _finite(m.get("load_imbalance")):
        parts.append(f"imbalance {m['load_imbalance']:.2f}")
    if _finite(m.get("dropped_fraction")) and m["dropped_fraction"]:
        parts.append(f"dropped {100 * m['dropped_fraction']:.1f}%")
    if "val_loss" in m:
        parts.append(f"val_loss {m['val_loss']:.4f}")
    return " | ".join(parts)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


SUPERSEDED_FILE = "metrics.superseded.jsonl"
"""Beside metrics.jsonl: the records a resumed run logs again, moved there as it starts."""


class MetricsSinks:
    """metrics.jsonl (appended, flushed each write) and TensorBoard (when installed and enabled).

    metrics.jsonl is the record: a failure writing it stops the run (an OutputError naming it).
    TensorBoard's events are a second copy of it, for viewing: a failure writing them (EIO, a full
    disk) is said once and turns them off for the rest of the run, which trains on; stopping would
    cost the training since the last checkpoint for a copy of what metrics.jsonl still holds."""

    def __init__(self, run_dir: Path, tensorboard: bool, out: Callable[[str], None] = print, first_step: int = 1):
        """`first_step`: the first step this run logs (a resumed run's: its checkpoint's + 1)."""
        self.jsonl_path = Path(run_dir) / "metrics.jsonl"
        self.tb_path, self.out = Path(run_dir) / "tb", out
        with writing(self.jsonl_path):
            whole = _whole_lines_size(self.jsonl_path)
            self.jsonl = open(self.jsonl_path, "ab", buffering=0)  # each record on disk as it is written
            if whole is not None:  # a record cut short (a kill or crash mid-write): the appends follow a whole line
                cut = os.fstat(self.jsonl.fileno()).st_size - whole
                self.jsonl.truncate(whole)
                out(f"{self.jsonl_path}: removed its last line, an incomplete record of {cut} bytes "
                    "(a write cut short)")
            self._supersede(first_step)
        self.tb = None
        if tensorboard:
            with self._tensorboard_or_off():
                self.tb = _tensorboard_writer(self.tb_path, first_step)

    def _supersede(self, first_step: int) -> None:
        """Records of steps from `first_step` on (a run killed after its last checkpoint logged
        them; this resumed run logs them again) move to SUPERSEDED_FILE beside metrics.jsonl, as
        TensorBoard's purge_step hides their events: each step is in metrics.jsonl once, and
        nothing written is lost. Appended there and flushed to disk before they leave the record."""
        with open(self.jsonl_path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            cut = _tail_from_step(f, first_step)
            tail = os.pread(f.fileno(), size - cut, cut)
        if not tail:
            return
        side = self.jsonl_path.with_name(SUPERSEDED_FILE)
        with writing(side):
            with open(side, "ab") as f:
                f.write(tail)
                f.flush()
                os.fsync(f.fileno())
            fsync(side.parent)  # its name too, where the first resume created it
        self.jsonl.truncate(cut)
        first, last = (_record_step(line) for line in (tail.splitlines()[0], tail.splitlines()[-1]))
        steps = f"step {first}" if first == last else f"steps {first}–{last}"
        self.out(f"{self.jsonl_path}: moved the records of {steps}, logged after the checkpoint this run "
                 f"resumes from, to {side}: this run logs them again")

    def write(self, record: dict[str, Any]) -> None:
        self._append_line((json.dumps(finite_or_null(record), allow_nan=False) + "\n").encode())
        if self.tb is not None:
            with self._tensorboard_or_off():
                for tag, value in _scalars(record):
                    self.tb.add_scalar(tag, value, record["step"])

    @contextlib.contextmanager
    def _tensorboard_or_off(self):
        """An OSError writing TensorBoard's events (raised by the call that follows the failed
        write: its writer writes on a thread) is said and turns them off; the failed writer is
        dropped, not closed, since closing flushes into the same failure."""
        try:
            with writing(self.tb_path):
                yield
        except OutputError as e:
            self.tb = None
            self.out(f"warning: writing {e.filename}: [Errno {e.errno}] {e.strerror}; TensorBoard events are "
                     "off for the rest of this run (metrics.jsonl holds every record)")

    def _append_line(self, line: bytes) -> None:
        """The whole line or nothing: a write cut short (a full disk) is undone, so the file stays
        one JSON record per line for readers and for a resumed run's appends."""
        with writing(self.jsonl_path):
            start = os.fstat(self.jsonl.fileno()).st_size
            try:
                rest = memoryview(line)
                while rest:
                    rest = rest[self.jsonl.write(rest):]
            except OSError:
                self.jsonl.truncate(start)
                raise

    def sync(self) -> None:
        """metrics.jsonl's records on disk (before a checkpoint of their steps: the run resumed
        from it logs only the steps after it)."""
        with writing(self.jsonl_path):
            os.fsync(self.jsonl.fileno())

    def close(self) -> None:
        self.jsonl.close()
        if self.tb is not None:
            with self._tensorboard_or_off():
                self.tb.close()


def _scalars(record: dict[str, Any]) -> list[tuple[str, float]]:
    """TensorBoard's (tag, value) of a record's finite numbers: a per-layer list's element i as
    `<key>/<i>` (a scalar each: TensorBoard has no list), so the per-layer load is there too."""
    scalars = []
    for key, value in record.items():
        items = [(f"{key}/{i}", v) for i, v in enumerate(value)] if isinstance(value, list) else [(key, value)]
        scalars += [(tag, v) for tag, v in items
                    if isinstance(v, (int, float)) and key != "step" and math.isfinite(v)]
    return scalars


def _whole_lines_size(path: Path) -> int | None:
    """The size of `path` up to the newline that ends its last whole line, when it ends in an
    incomplete one; None when it ends with a newline (or is empty or missing)."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return None
    with f:
        end = f.seek(0, os.SEEK_END)
        if end == 0 or os.pread(f.fileno(), 1, end - 1) == b"\n":
            return None
        while end > 0:  # backwards, a block at a time: the file holds the whole run's records
            start = max(0, end - 2**16)
            newline = os.pread(f.fileno(), end - start, start).rfind(b"\n")
            if newline >= 0:
                return start + newline + 1
            end = start
        return 0


def _record_step(line: bytes) -> int | None:
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):  # not a record of ours: kept where it is
        return None
    return step if isinstance(step, int) else None


def _tail_from_step(f, first_step: int) -> int:
    """The offset in metrics.jsonl (`f`, open to read; whole lines) of its last records whose steps are
    `first_step` or later, its size when none. Records are appended in step order, so those are
    at the end: read backwards, a growing block at a time (the file holds the whole run's)."""
    size = os.fstat(f.fileno()).st_size
    block = 2**16
    while True:
        start = max(0, size - block)
        lines = os.pread(f.fileno(), size - start, start).split(b"\n")[:-1]
        whole = lines if start == 0 else lines[1:]  # the block's first line may start before it
        tail = 0
        for line in reversed(whole):
            step = _record_step(line)
            if step is None or step < first_step:
                return size - tail
            tail += len(line) + 1
        if start == 0:
            return 0
        block *= 4


def finite_or_null(value: Any) -> Any:
    """nan and ±inf as null: JSON has no spelling for them (Python's NaN is refused by strict
    readers, and jq reads it as null anyway); the console line keeps the value."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite_or_null(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


class NullSinks:
    """What ranks other than 0 write: nothing."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass


def _tensorboard_writer(path: Path, first_step: int):
    """The events of earlier runs in `path` from `first_step` on are hidden (`purge_step`): a run
    killed after its last checkpoint logged steps the resumed run logs again, which TensorBoard
    would otherwise draw twice (metrics.jsonl moves the earlier records aside: `_supersede`)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # the `viz` extra is optional
        return None
    return SummaryWriter(str(path), purge_step=first_step)


def is_interactive() -> bool:
    return sys.stderr.isatty()
