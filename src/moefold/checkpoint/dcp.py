"""Atomic training checkpoints with torch.distributed.checkpoint (DCP), also in one process.

A checkpoint is a DCP directory `<run_dir>/checkpoints/step_<N>` holding the state after N optimizer
steps: model, optimizer, data position, step and RNG (the lr schedule is the config's at that step;
checkpoints of earlier versions also hold the scheduler's state). It is written under a `.tmp` name
and renamed when complete, so a save killed half-way never replaces or damages the last good one;
a checkpoint rotated out is renamed `.old` before it is deleted, so a removal killed half-way never
leaves a complete-looking one with shards missing. Leftover `.tmp` and `.old` directories, of any
step, are ignored and removed by the next save.
"""

import contextlib
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from moefold.errors import FULL_OR_READ_ONLY, CheckpointError, OutputError, writing
from moefold.files import fsync
from moefold.parallel.local import local_tensor
from moefold.train.run_lock import refuse_run_dir_in_use

CHECKPOINTS = "checkpoints"
RUN_CONFIG = "config.toml"  # a run directory's config (the trainer writes it)
_STEP_DIR = re.compile(r"^step_(\d+)$")
_LEFTOVER = re.compile(r"^step_\d+\.(tmp|old)$")  # of a save or a removal cut short
_METADATA = ".metadata"  # written by DCP's FileSystemWriter last, once every shard is on disk


@contextlib.contextmanager
def _single_process_ok():
    """Saving and loading in one process without a process group is intended, not a mistake."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step_{step:08d}"


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in the run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / _METADATA).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def is_checkpoint_name(name: str) -> bool:
    """Whether `name` is a complete checkpoint's directory name, `step_<N>` (not a leftover `.tmp`
    or `.old` of a save or a removal cut short)."""
    return _STEP_DIR.match(name) is not None


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint directory `step_<N>` holds."""
    return int(_STEP_DIR.match(Path(path).name).group(1))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1][1] if found else None


def resolve_checkpoint(path: Path, option: str = "--resume") -> Path:
    """A checkpoint directory from a run directory (its latest), the run's checkpoints folder (its
    latest too: what Megatron-LM's --load and TorchTitan's checkpoint.folder name) or a checkpoint
    directory itself; `option` names where the path came from in errors. A checkpoint is named by
    its step as typed too: `RUN/checkpoints/step_2` is the saved `step_00000002`. A relative path is
    read from the working directory (`step_2` or `.` inside the checkpoints folder: their run is
    named by no part of the path as written), and the checkpoint returned is absolute."""
    path = _saved_name(Path(os.path.abspath(path)))
    if not path.exists():
        raise CheckpointError(f"{option} {path}: {_what_is_missing(path)}")
    if _STEP_DIR.match(path.name):
        if not (path / _METADATA).is_file():
            raise CheckpointError(f"{option} {path}: incomplete or corrupt checkpoint (no {_METADATA})")
        return path
    refuse_checkpoints_leftover(path, option)
    run_dir = run_of_checkpoints_folder(path) or path
    latest = latest_checkpoint(run_dir)
    if latest is None:
        refuse_run_dir_in_use(run_dir, option)  # a training there has not saved yet: name it, not the missing save
        raise CheckpointError(f"{option} {path}: no complete checkpoint in {run_dir / CHECKPOINTS}")
    return latest


def _saved_name(path: Path) -> Path:
    """`RUN/checkpoints/step_<N>` as saved: N is written in 8 digits (`checkpoint_path`), and a user
    types the step (`step_100`). A name that exists, or that no complete checkpoint of the run
    holds the step of, is left as given (to be read, or said missing); `.tmp`/`.old` are no step's."""
    run_dir = run_of_checkpoints_entry(path)
    if path.exists() or run_dir is None or not is_checkpoint_name(path.name):
        return path
    step = checkpoint_step(path)
    return next((found for saved, found in complete_checkpoints(run_dir) if saved == step), path)


def _what_is_missing(path: Path) -> str:
    """What a path that does not exist is said to be. One of a run's checkpoints (`RUN/checkpoints/
    step_<N>`: rotated out by checkpoint.keep, or mistyped) is named with those the run holds."""
    run_dir = run_of_checkpoints_entry(path)
    if run_dir is None or not is_checkpoint_name(path.name):
        return "no such directory"
    return f"no such checkpoint; {_held_checkpoints(run_dir)}"


def _held_checkpoints(run_dir: Path, now: str = "") -> str:
    """The run's complete checkpoints, said by name (`now`: ' now', once one was deleted)."""
    held = [found.name for _, found in complete_checkpoints(run_dir)]
    if not held:
        return f"the run holds no complete checkpoint{now} (in {run_dir / CHECKPOINTS})"
    return f"the run's complete checkpoints are{now} {', '.join(held)} (in {run_dir / CHECKPOINTS})"


def is_run_dir(path: Path) -> bool:
    """Whether `path` is a run directory: it holds the run's config.toml, which a training writes
    before its first checkpoint and a conversion after its only one."""
    return (Path(path) / RUN_CONFIG).is_file()


def run_of_checkpoints_folder(path: Path) -> Path | None:
    """The run whose checkpoints folder `path` is (`RUN/checkpoints`); None for any other path,
    a run itself kept in a folder named checkpoints too. The run is absolute: `.` or `..` name no
    folder as written."""
    path = Path(os.path.abspath(path))
    if path.name == CHECKPOINTS and not is_run_dir(path) and is_run_dir(path.parent):
        return path.parent
    return None


def run_of_checkpoints_entry(path: Path) -> Path | None:
    """The run whose checkpoints folder holds `path` (`RUN/checkpoints/NAME`: a checkpoint, a
    leftover or anything else); None for any other path, a run itself kept there too. The run is
    absolute, as `run_of_checkpoints_folder`'s: `step_2`'s folder is `.` as written."""
    path = Path(os.path.abspath(path))
    return run_of_checkpoints_folder(path.parent) if not is_run_dir(path) else None


_LEFTOVER_KINDS = {".tmp": "an unfinished save", ".old": "a checkpoint being deleted"}
"""What the leftovers under a run's checkpoints folder are, by suffix (`save_checkpoint`, `_rotate`)."""


def refuse_checkpoints_leftover(path: Path, option: str = "--resume") -> None:
    """Refuses `RUN/checkpoints/NAME` where NAME is no complete checkpoint's (a save killed before
    its rename left `step_<N>.tmp`), naming what it is and what resumes: read as a run directory it
    would be one with no checkpoints/ of its own. Shared by the command line and `Trainer`."""
    path = Path(path)
    run_dir = run_of_checkpoints_entry(path)
    if run_dir is None or is_checkpoint_name(path.name):
        return
    what = _LEFTOVER_KINDS.get(path.suffix, "not a checkpoint's name, step_<N>")
    raise CheckpointError(f"{option} {path}: not a complete checkpoint ({what}); give the run directory {run_dir} "
                          f"(its latest checkpoint) or one of its complete checkpoints, {path.parent}/step_<N>")


def save_checkpoint(state: dict[str, Any], run_dir: Path, step: int, keep: int) -> Path:
    """Write `state` as checkpoint `step` atomically, then delete all but the newest `keep`.

    With a process group this is a collective: every rank writes its shards into the same `.tmp`
    directory, and rank 0 renames it once DCP has written the metadata (after all shards)."""
    final = checkpoint_path(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    coordinator = not dist.is_initialized() or dist.get_rank() == 0
    if coordinator:
        with writing(final):
            _remove_leftovers(final.parent)  # a save killed at another step is resumed from the one before
    _barrier()
    try:
        with _single_process_ok():
            dcp.save(state, checkpoint_id=tmp)
    except (Exception, CheckpointException) as e:  # DCP raises it on every rank when one fails
        failure = _save_failure(final, state, e)
        if coordinator:
            shutil.rmtree(tmp, ignore_errors=True)  # the partial shards: space back, nothing to mistake
        raise failure from None
    _barrier()
    if coordinator:
        with writing(final):
            _replace_dir(tmp, final)
            _rotate(run_dir, keep)
    _barrier()  # nobody reads or writes checkpoints before the rename
    return final


def _rotate(run_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints."""
    for _, old in complete_checkpoints(run_dir)[:-keep]:
        doomed = old.with_name(old.name + ".old")
        shutil.rmtree(doomed, ignore_errors=True)
        os.replace(old, doomed)  # no longer complete before any of it is deleted
        shutil.rmtree(doomed, ignore_errors=True)


def _remove_leftovers(root: Path) -> None:
    if not root.is_dir():
        return
    for path in root.iterdir():
        if _LEFTOVER.match(path.name):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def _save_failure(final: Path, state: dict[str, Any], error: BaseException) -> Exception:
    """What a failed save raises. The storage's own failure (EIO, a stale NFS handle): an
    OutputError naming the checkpoint. Else a CheckpointError in one line: why, the room it needed
    against what its filesystem had left (a full disk surfaces as an opaque write error from
    torch.save), and that nothing already saved changed."""
    cause = _cause(error)
    if isinstance(cause, OSError) and cause.errno is not None and cause.errno not in FULL_OR_READ_ONLY:
        return OutputError(cause.errno, cause.strerror, str(final))
    try:
        free = f"{shutil.disk_usage(final.parent).free / 2**20:,.1f} MiB free"
    except OSError:
        free = "free space unknown"
    needed = f"this rank's tensors take {_tensor_bytes(state) / 2**20:,.1f} MiB, {free}"
    latest = latest_checkpoint(final.parent.parent)
    kept = f"the latest complete checkpoint, {latest.name}, is intact" if latest else "no earlier checkpoint"
    return CheckpointError(f"saving checkpoint {final} failed ({_reason(error)}; {needed}); {kept}")


def _tensor_bytes(value: Any) -> int:
    """Bytes of the tensors (a DTensor's local piece) in a nested state dict."""
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    if isinstance(value, torch.Tensor):
        return local_tensor(value).nbytes
    return 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename src to dst durably; an existing dst (a re-save of the same step) is swapped out
    first. DCP flushes each file but names `.metadata` by a rename inside src: src's entries
    reach the disk before src is renamed (`files.py`), or a power cut could leave dst incomplete
    once the rotation has deleted the checkpoint before it."""
    fsync(src)
    if dst.exists():
        old = dst.with_name(dst.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)
    fsync(dst.parent)


def load_checkpoint(state: dict[str, Any], path: Path) -> None:
    """Load checkpoint `path` into `state` in place (tensors are copied into the given ones; other
    values are replaced). Only the keys present in `state` are read."""
    metadata = _read_metadata(path)
    _refuse_other_model_shapes(state.get("model", {}), metadata, path)
    _skip_unsaved_generators(state.get("rng"), metadata)
    try:
        _load(state, path, metadata)
    finally:
        _last_metadata.clear()  # it lists every chunk of every tensor: not kept past the load


def load_value(path: Path, key: str) -> Any:
    """One small non-tensor value checkpoint `path` holds (its config), read before its full load,
    which reuses the metadata this read."""
    state = {key: ""}
    _load(state, path, _read_metadata(path))
    return state[key]


def _load(state: dict[str, Any], path: Path, metadata) -> None:
    try:
        with _single_process_ok():
            dcp.load(state, checkpoint_id=path, storage_reader=_ReaderWithMetadata(path, metadata))
    except (Exception, CheckpointException) as e:  # any reader failure means "unreadable"
        if not (Path(path) / _METADATA).is_file():  # gone during the read: not corrupt
            raise CheckpointError(_deleted_while_read(Path(path))) from None
        raise CheckpointError(f"checkpoint {path} is unreadable or corrupt: {_reason(e)}") from None


def _deleted_while_read(path: Path) -> str:
    """Why a load failed whose checkpoint is gone, with what its run holds now. Right whether the
    run's latest was read or a step was named (the load is not told which, and only this failure
    pays for the listing): a named step gone is not read by reading the latest again."""
    what = (f"checkpoint {path} was deleted while it was read (its run saved a later one and checkpoint.keep "
            "rotated it out?)")
    run_dir = run_of_checkpoints_entry(path)
    if run_dir is None:
        return what
    if not complete_checkpoints(run_dir):
        return f"{what}; {_held_checkpoints(run_dir, ' now')}"
    return (f"{what}; {_held_checkpoints(run_dir, ' now')}: run the command again with the run directory to read "
            "its latest, or with one of them")


def _skip_unsaved_generators(rng: dict[str, Any] | None, metadata) -> None:
    """A checkpoint saved where CUDA was not available holds no CUDA generator state: resumed where
    it is, the CUDA generator keeps its seeded state (the run drew nothing from it) instead of the
    load failing on the missing key."""
    if isinstance(rng, dict):
        for name in [name for name in rng if f"rng.{name}" not in metadata.state_dict_metadata]:
            del rng[name]


class _ReaderWithMetadata(dcp.FileSystemReader):
    """DCP's file reader, handed the `.metadata` the checks before the load read: every rank reads
    it, and a large job's lists every chunk of every saved tensor, so it is read once, not again
    by the load."""

    def __init__(self, path: Path, metadata):
        super().__init__(str(path))
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any):
        if args or kwargs:  # a rank's own metadata file (DCP's fallback): its own read
            return super().read_metadata(*args, **kwargs)
        if getattr(self._metadata, "storage_meta", None) is not None:  # as FileSystemReader's read
            self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


def _refuse_other_model_shapes(model_state: dict[str, Any], metadata, path: Path) -> None:
    """A model built with other shapes than the checkpoint's (a resume that changed model.* or
    moe.*) is named for what it is, not reported as a corrupt checkpoint; tensors one has and the
    other lacks (MTP modules, a tied head, the expert bias) are refused too, never dropped."""
    if not model_state:
        return
    saved_names = {key.removeprefix("model.") for key in metadata.state_dict_metadata if key.startswith("model.")}
    for names, holder, lacker in ((saved_names - model_state.keys(), f"checkpoint {path}", "this model"),
                                  (model_state.keys() - saved_names, "this model", f"checkpoint {path}")):
        if names:
            listed = ", ".join(sorted(names)[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise CheckpointError(f"{holder} holds {listed}, which {lacker} lacks: a run continues with the "
                                  "model.* and moe.* it was trained with")
    for name, tensor in model_state.items():
        saved = metadata.state_dict_metadata.get(f"model.{name}")
        saved_size = getattr(saved, "size", None)  # tensors only
        if isinstance(tensor, torch.Tensor) and saved_size is not None and tuple(saved_size) != tuple(tensor.shape):
            raise CheckpointError(
                f"checkpoint {path} holds {name} as {list(saved_size)} but this model's is {list(tensor.shape)}: "
                "a run continues with the model.* and moe.* it was trained with")


def _reason(error: BaseException) -> str:
    """One line on why a load or save failed."""
    error = _cause(error)
    text = " ".join(str(error).split()) or type(error).__name__
    return f"{type(error).__name__}: {text}"[:300]


def _cause(error: BaseException) -> BaseException:
    """The exception under DCP's CheckpointException, which wraps each rank's (newer torch: as an
    (exception, traceback) pair)."""
    if isinstance(error, CheckpointException) and error.failures:
        inner = next(iter(error.failures.values()))
        if isinstance(inner, tuple):
            inner = next((x for x in inner if isinstance(x, BaseException)), inner)
        error = getattr(inner, "exception", inner)
    return error


_last_metadata: dict[tuple, Any] = {}
"""The last `.metadata` read, by its file's identity: `checkpoint_keys` and the load share it."""


def _read_metadata(path: Path):
    try:
        stat = (Path(path) / _METADATA).stat()
        identity = (str(path), stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if identity not in _last_metadata:
            metadata = dcp.FileSystemReader(str(path)).read_metadata()
            _last_metadata.clear()
            _last_metadata[identity] = metadata
        return _last_metadata[identity]
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} is unreadable or corrupt: {_reason(e)}") from None


def checkpoint_keys(path: Path) -> set[str]:
    """The top-level keys a checkpoint holds ("model", "optim", ...), from its metadata alone."""
    metadata = _read_metadata(path)
    return {key.split(".", 1)[0] for key in metadata.state_dict_metadata}


def load_weights(model: nn.Module, path: Path, exact_masters: bool = False) -> None:
    """The weights of checkpoint `path` (weights-only or full) into `model`'s own tensors, whole or
    this rank's pieces. `exact_masters` (fp32 parameters): a bf16+remainder run's exact fp32
    masters, its bf16 weights joined with the int16 remainders its optimizer state holds, read in
    the same load; other runs' parameters are their masters already."""
    from moefold.optim.precision import join_fp32

    saved = _read_metadata(path).state_dict_metadata if exact_masters else {}
    remainders = {name: {"master_remainder": torch.empty(p.shape, dtype=torch.int16)}
                  for name, p in model.named_parameters() if f"optim.state.{name}.master_remainder" in saved}
    state = {"model": model.state_dict(), **({"optim": {"state": remainders}} if remainders else {})}
    load_checkpoint(state, path)
    model.load_state_dict(state["model"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in remainders:
                p.copy_(join_fp32(p.to(torch.bfloat16), remainders[name]["master_remainder"]))


def save_weights_only(model_state: dict[str, Any], run_dir: Path) -> Path:
    """A step-0 checkpoint holding only model weights (a converted model): training from it starts
    with fresh optimizer, schedule and data order."""
    return save_checkpoint({"model": model_state, "step": 0}, run_dir, 0, keep=1)


def rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
