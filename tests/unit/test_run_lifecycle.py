"""A run directory's life on the CPU: train, stop, resume, convert, generate — each bad input one
line and exit status 2, with nothing already written lost."""

from pathlib import Path

import pytest
import torch

from moefold.cli import main
from test_bad_input import error_line


def snapshot(run_dir: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


@pytest.fixture
def finished_run(tmp_path, tiny_args) -> Path:
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "3"]) == 0
    return run


# ------------------------------------------------------------------------ resume with other data

@pytest.mark.parametrize("override, named", [
    (["--train.seq_len", "16"], "train.seq_len"),
    (["--train.seed", "7"], "train.seed"),
    (["--data.val_fraction", "0.5"], "data.path, data.tokenizer or data.val_fraction"),
])
def test_a_resume_over_other_training_data_is_refused_in_one_line(finished_run, tmp_path, capsys, override, named):
    """The checkpoint's data position (epoch, cursor) counts in its run's sequences and seeded
    order; over other ones it trained on, silently repeating some sequences and skipping others."""
    before = snapshot(finished_run)
    line = error_line(capsys, ["train", "--resume", str(finished_run), "--train.steps", "5", *override])
    assert named in line and "step_00000003" in line
    assert snapshot(finished_run) == before


def test_a_resume_with_another_batch_size_continues_the_same_data_order(finished_run, capsys):
    """The position counts sequences, so the batch size may change: not refused."""
    assert main(["train", "--resume", str(finished_run), "--train.steps", "5",
                 "--train.micro_batch_size", "2"]) == 0


# ------------------------------------------------------------------------ corrupt Hugging Face files

@pytest.fixture
def hf_export(tmp_path) -> Path:
    """A tiny model exported to Hugging Face safetensors in one file."""
    from moefold.checkpoint.hf import save_pretrained
    from moefold.config import load_config
    from moefold.models.transformer import build_model

    torch.manual_seed(0)
    model = build_model(load_config("tiny-qwen3"), 257, "cpu", torch.float32)
    save_pretrained(model, tmp_path / "hf")
    return tmp_path / "hf"


def _cut_short(file: Path, keep: int) -> None:
    file.write_bytes(file.read_bytes()[:keep])


@pytest.mark.parametrize("keep", [5000, -1000], ids=["header-cut", "data-cut"])
def test_a_cut_short_safetensors_file_is_one_line_for_convert_and_init_from_hf(hf_export, tmp_path, capsys,
                                                                               tiny_args, keep):
    """A download or copy cut short ended `convert --from-hf` and `train --init-from-hf` in a
    safetensors traceback (exit 1)."""
    weights = hf_export / "model.safetensors"
    _cut_short(weights, keep)
    line = error_line(capsys, ["convert", "--from-hf", str(hf_export), "--out", str(tmp_path / "run")])
    assert str(weights) in line and "not a readable safetensors file" in line
    assert not (tmp_path / "run").exists()
    line = error_line(capsys, ["train", "--init-from-hf", str(hf_export), "--run-dir", str(tmp_path / "ft"),
                               *tiny_args])
    assert str(weights) in line and not (tmp_path / "ft").exists()


def test_a_cut_short_shard_of_a_sharded_checkpoint_is_one_line(tmp_path, capsys):
    from moefold.checkpoint.hf import save_pretrained
    from moefold.config import load_config
    from moefold.models.transformer import build_model

    model = build_model(load_config("tiny-qwen3"), 257, "cpu", torch.float32)
    save_pretrained(model, tmp_path / "hf", max_shard_bytes=2**16)
    shard = sorted((tmp_path / "hf").glob("*.safetensors"))[-1]
    _cut_short(shard, -100)
    line = error_line(capsys, ["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")])
    assert str(shard) in line and not (tmp_path / "run").exists()


# ------------------------------------------------------------------------ TensorBoard after a resume

def _run_killed_after_its_last_checkpoint(tmp_path, tiny_args) -> Path:
    """A run that logged steps 1-6 and saved at 3 (as if killed at step 6 before its next save)."""
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "6", "--checkpoint.every", "3",
                 "--checkpoint.keep", "2", "--logging.tensorboard", "true"]) == 0
    for path in (run / "checkpoints" / "step_00000006").iterdir():
        path.unlink()
    (run / "checkpoints" / "step_00000006").rmdir()
    return run


def test_a_resumed_run_hides_the_tensorboard_steps_it_logs_again(tmp_path, tiny_args, monkeypatch):
    """Steps 4-6, logged by the run before it was killed and again by the resumed one, were drawn
    twice in TensorBoard; the resumed run's writer purges the earlier events from its first step."""
    import moefold.train.metrics as metrics

    first_steps = []
    monkeypatch.setattr(metrics, "_tensorboard_writer", lambda path, first_step: first_steps.append(first_step))
    run = _run_killed_after_its_last_checkpoint(tmp_path, tiny_args)
    assert main(["train", "--resume", str(run), "--train.steps", "8"]) == 0
    assert first_steps == [1, 4]


def test_tensorboard_shows_each_step_once_after_a_resume(tmp_path, tiny_args):
    """The same, read back by TensorBoard itself (where the viz extra is installed)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = _run_killed_after_its_last_checkpoint(tmp_path, tiny_args)
    assert main(["train", "--resume", str(run), "--train.steps", "8", "--train.lr", "1e-4"]) == 0
    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == list(range(1, 9))


# ------------------------------------------------------------------------ convert into an existing directory

def test_a_failed_conversion_into_an_existing_directory_leaves_no_checkpoint_behind(hf_export, tmp_path, capsys,
                                                                                    failing_config_toml_write):
    """EIO writing config.toml left `--out`, a directory that was there, with checkpoints/ and no
    config.toml: a run that neither resumes (no config.toml) nor converts again (it holds a run)."""
    out = tmp_path / "run"
    out.mkdir()
    assert main(["convert", "--from-hf", str(hf_export), "--out", str(out)]) == 1
    assert not (out / "checkpoints").exists()
    failing_config_toml_write.undo()
    assert main(["convert", "--from-hf", str(hf_export), "--out", str(out)]) == 0


def test_convert_into_a_directory_whose_lock_file_is_a_directory_is_one_line(hf_export, tmp_path, capsys):
    """open(.lock) raised IsADirectoryError: a traceback (a training refuses such a run directory
    in one line already)."""
    out = tmp_path / "run"
    (out / ".lock").mkdir(parents=True)
    line = error_line(capsys, ["convert", "--from-hf", str(hf_export), "--out", str(out)])
    assert "--out" in line and ".lock is a directory" in line
    assert sorted(p.name for p in out.iterdir()) == [".lock"]
