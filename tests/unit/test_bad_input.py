"""Every bad input gives one clear line, exit status 2, and leaves existing run files intact."""

import errno
import os
import re
from pathlib import Path

import pytest
import torch

from moefold.cli import main
from moefold.train.trainer import Trainer


def snapshot(run_dir):
    return {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


@pytest.fixture
def finished_run(tmp_path, tiny_args):
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "3"]) == 0
    return run


def error_line(capsys, argv) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.mark.parametrize("argv, expected", [
    ([], "moefold: error: the following arguments are required: {train,generate,convert,config,plan,bench} "
         "(see moefold --help)"),
    (["config"], "moefold: error: the following arguments are required: {show,presets,params} "
                 "(see moefold config --help)"),
    (["train", "--train.steps"], "moefold: error: argument --train.steps: expected one argument "
                                 "(see moefold train --help)"),
    (["train", "--nproc", "two"], "moefold: error: argument --nproc: invalid int value: 'two' "
                                  "(see moefold train --help)"),
    (["generate", "--run-dir", "r"], "moefold: error: the following arguments are required: --prompt "
                                     "(see moefold generate --help)"),
])
def test_a_malformed_command_line_is_one_line_not_the_usage(capsys, argv, expected):
    """argparse would print the usage first: a hundred lines for `train`, one option per field."""
    assert error_line(capsys, argv) == expected


@pytest.mark.parametrize("make_path, expected", [
    (lambda tmp: tmp / "missing", "no such file or directory"),
    (lambda tmp: (tmp / "empty").mkdir() or tmp / "empty", "data.path="),
    (lambda tmp: (tmp / "empty.txt").write_text("") and None or tmp / "empty.txt", "data.path="),
    (lambda tmp: (tmp / "x.csv").write_text("a,b") and None or tmp / "x.csv", "data.path="),
])
def test_bad_data_path(tmp_path, capsys, tiny_args, make_path, expected):
    path = make_path(tmp_path)
    line = error_line(capsys, ["train", "--run-dir", str(tmp_path / "r"), *tiny_args, "--data.path", str(path)])
    assert "data.path" in line and expected in line
    assert not (tmp_path / "r").exists()


def test_corrupt_checkpoint(finished_run, capsys):
    shard = next((finished_run / "checkpoints").rglob("*.distcp"))
    shard.write_bytes(b"garbage" * 10)
    before = snapshot(finished_run)
    line = error_line(capsys, ["train", "--resume", str(finished_run), "--train.steps", "6"])
    assert "unreadable or corrupt" in line and str(shard.parent) in line
    assert snapshot(finished_run) == before


def test_checkpoint_without_metadata_and_missing_resume_dir(finished_run, tmp_path, capsys):
    ckpt = next((finished_run / "checkpoints").iterdir())
    (ckpt / ".metadata").unlink()
    before = snapshot(finished_run)
    assert "no complete checkpoint" in error_line(capsys, ["train", "--resume", str(finished_run)])
    assert "incomplete or corrupt" in error_line(capsys, ["train", "--resume", str(ckpt)])
    assert "not a moefold run directory" in error_line(capsys, ["train", "--resume", str(tmp_path / "nope")])
    assert snapshot(finished_run) == before


def test_existing_run_is_not_overwritten(finished_run, tiny_args, capsys):
    before = snapshot(finished_run)
    line = error_line(capsys, ["train", "--run-dir", str(finished_run), *tiny_args])
    assert "already holds a run" in line and "--resume" in line
    assert snapshot(finished_run) == before


def test_run_without_checkpoint_is_not_overwritten_nor_offered_to_resume(finished_run, tmp_path, tiny_args, capsys):
    """A run that stopped before its first save: --resume could not continue it, so the refusal
    does not suggest it."""
    early = tmp_path / "early"
    early.mkdir()
    for name in ("config.toml", "metrics.jsonl"):
        (early / name).write_bytes((finished_run / name).read_bytes())
    before = snapshot(early)
    line = error_line(capsys, ["train", "--run-dir", str(early), *tiny_args])
    assert "saved no checkpoint to resume" in line and "--resume" not in line
    assert "no complete checkpoint" in error_line(capsys, ["train", "--resume", str(early)])
    assert snapshot(early) == before


@pytest.mark.parametrize("argv, expected", [
    (["--moe.topk", "4"], "unknown option --moe.topk; did you mean --moe.top_k?"),
    (["--train.lr", "-1"], "train.lr=-1.0 must be > 0"),
    (["--config", "nosuch"], "--config nosuch: no such preset or file"),
    (["--data.val_fraction", "1.5"], "data.val_fraction=1.5 must be in [0, 1)"),
])
def test_config_errors(finished_run, tmp_path, capsys, argv, expected):
    before = snapshot(finished_run)
    assert expected in error_line(capsys, ["train", "--run-dir", str(tmp_path / "new"), *argv])
    assert error_line(capsys, ["train", "--resume", str(finished_run), *argv[:2]]) if argv[0] != "--config" else True
    assert snapshot(finished_run) == before
    assert not (tmp_path / "new").exists()


def test_bad_tokenizer_file(tmp_path, tiny_args, capsys):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    line = error_line(capsys, ["train", "--run-dir", str(tmp_path / "r"), *tiny_args, "--data.tokenizer", str(bad)])
    assert "data.tokenizer" in line


@pytest.mark.parametrize("command", ["generate", "convert"])
def test_generate_and_convert_on_a_non_run(tmp_path, capsys, command):
    """A directory without config.toml is not a run: said as such, not as a run without checkpoints."""
    (tmp_path / "checkpoints").mkdir()
    output = ["--prompt", "x"] if command == "generate" else ["--to-hf", str(tmp_path / "hf")]
    assert "not a moefold run directory" in error_line(capsys, [command, "--run-dir", str(tmp_path), *output])


@pytest.mark.parametrize("option, value, expected", [
    ("--max-new-tokens", "-5", "--max-new-tokens -5 must be >= 0"),
    ("--temperature", "-1", "--temperature -1.0 must be >= 0 (0 is greedy)"),
    ("--temperature", "nan", "--temperature nan must be >= 0"),
    ("--top-k", "-1", "--top-k -1 must be >= 0"),
    ("--seed", str(2**64), f"--seed {2**64} must be in [0, 2**63)"),
])
def test_generate_refuses_bad_sampling_options_before_loading(tmp_path, capsys, option, value, expected):
    # tmp_path is no run: the options are checked first
    assert expected in error_line(capsys, ["generate", "--run-dir", str(tmp_path), "--prompt", "x", option, value])


def test_generate_refuses_an_empty_prompt(finished_run, capsys):
    assert "--prompt '' encodes to no tokens" in error_line(
        capsys, ["generate", "--run-dir", str(finished_run), "--prompt", ""])


@pytest.mark.parametrize("nproc", [[], ["--nproc", "2"]])
def test_run_dir_that_is_a_file_is_refused_before_training(tmp_path, tiny_args, capsys, nproc):
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    for run_dir in (taken, taken / "run"):
        line = error_line(capsys, ["train", "--run-dir", str(run_dir), *tiny_args, *nproc])
        assert line.endswith(f"--run-dir {run_dir}: {taken} is a file, not a directory")
    assert taken.read_text() == "mine"


def _unwritable_dirs(tmp_path):
    """Directories this process cannot create in: a mode-0500 one (not for root, whom permission
    bits do not stop) and /proc (not even root: os.access says yes there)."""
    dirs = []
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        dirs.append(locked)
    if Path("/proc/self").is_dir():
        dirs.append(Path("/proc"))
    return dirs


def test_outputs_where_nothing_can_be_created_are_refused_before_any_work(finished_run, tmp_path, tiny_args,
                                                                         capsys):
    dirs = _unwritable_dirs(tmp_path)
    if not dirs:
        pytest.skip("no directory here that this process cannot write")
    for parent in dirs:
        for argv, option, target in (
                (["train", *tiny_args, "--run-dir"], "--run-dir", parent / "run"),
                (["convert", "--run-dir", str(finished_run), "--to-hf"], "--to-hf", parent / "hf" / "out"),
                (["convert", "--from-hf", str(tmp_path), "--out"], "--out", parent / "run"),
                (["bench", *tiny_args, "--steps", "1", "--profile"], "--profile", parent / "prof"),
                (["bench", *tiny_args, "--steps", "1", "--json"], "--json", parent / "r.json")):
            line = error_line(capsys, [*argv, str(target)])
            assert f"{option} {target}: cannot create anything in {parent} (" in line, line
            assert not target.exists()
    assert not [p for p in tmp_path.rglob(".moefold-write-check-*")]  # the probes are gone


def test_convert_refuses_a_file_or_an_existing_checkpoint_as_its_output(finished_run, tmp_path, capsys):
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    line = error_line(capsys, ["convert", "--run-dir", str(finished_run), "--to-hf", str(taken)])
    assert line.endswith(f"--to-hf {taken}: {taken} is a file, not a directory")
    line = error_line(capsys, ["convert", "--from-hf", str(tmp_path), "--out", str(taken / "run")])
    assert line.endswith(f"--out {taken / 'run'}: {taken} is a file, not a directory")
    hf = tmp_path / "hf"
    assert main(["convert", "--run-dir", str(finished_run), "--to-hf", str(hf)]) == 0
    written = snapshot(hf)
    line = error_line(capsys, ["convert", "--run-dir", str(finished_run), "--to-hf", str(hf)])
    assert "already holds a checkpoint (config.json)" in line
    assert snapshot(hf) == written and taken.read_text() == "mine"


def test_resume_with_other_model_shapes_names_them(finished_run, capsys):
    before = snapshot(finished_run)
    line = error_line(capsys, ["train", "--resume", str(finished_run), "--moe.num_experts", "2", "--train.steps", "6"])
    assert "holds layers.1.ffn.router.weight as [4, 32] but this model's is [2, 32]" in line
    assert "unreadable or corrupt" not in line and "model.* and moe.*" in line
    assert snapshot(finished_run) == before


def test_resume_with_fewer_steps_than_done_is_refused(finished_run, capsys):
    before = snapshot(finished_run)
    line = error_line(capsys, ["train", "--resume", str(finished_run), "--train.steps", "2"])
    assert line.endswith("train.steps=2: the run is already at step 3; give more steps to continue it")
    assert snapshot(finished_run) == before  # config.toml still says 3


def test_generate_and_convert_name_their_own_option_for_a_run_without_checkpoints(finished_run, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.toml").write_bytes((finished_run / "config.toml").read_bytes())
    for argv in (["generate", "--run-dir", str(bare), "--prompt", "x"],
                 ["convert", "--run-dir", str(bare), "--to-hf", str(tmp_path / "hf")]):
        assert error_line(capsys, argv).endswith(f"--run-dir {bare}: no complete checkpoint in {bare / 'checkpoints'}")
    assert not (tmp_path / "hf").exists()


def test_config_show_refuses_a_world_size_below_one(capsys):
    assert "--world-size 0 must be >= 1" in error_line(capsys, ["config", "show", "--world-size", "0"])


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_generate_names_its_own_device_option(finished_run, capsys):
    line = error_line(capsys, ["generate", "--run-dir", str(finished_run), "--prompt", "x", "--device", "cuda"])
    assert line.endswith("--device='cuda' but no CUDA device is available (use auto or cpu)")


CUDA_OOM = ("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 139.81 GiB "
            "of which 3.12 GiB is free. Including non-PyTorch memory, this process has 136.68 GiB in use.")


@pytest.mark.parametrize("allocate, expected", [
    (lambda: torch.empty(2**50, dtype=torch.uint8),  # the CPU allocator's own error, for real
     "tried to allocate 1048576.00 GiB of the CPU's memory"),
    (lambda: (_ for _ in ()).throw(torch.OutOfMemoryError(CUDA_OOM)),
     "tried to allocate 20.00 GiB. GPU 0 has a total capacity of 139.81 GiB"),
])
def test_running_out_of_memory_is_one_line_and_keeps_the_run(finished_run, capsys, monkeypatch,
                                                              allocate, expected):
    """A job larger than the machine is the user's to resize, not a bug: no traceback."""
    before = snapshot(finished_run)
    monkeypatch.setattr(Trainer, "train_step", lambda self: allocate())
    line = error_line(capsys, ["train", "--resume", str(finished_run), "--train.steps", "5"])
    assert line.startswith(f"moefold: error: out of memory: {expected}; "), line
    assert "moefold plan memory" in line
    after = snapshot(finished_run)
    config = finished_run / "config.toml"  # a resume records its new train.steps before training
    assert after.pop(config) != before.pop(config) and after == before


def test_other_runtime_errors_keep_their_traceback(finished_run, monkeypatch):
    def broken(self):
        raise RuntimeError("shape mismatch in a kernel")
    monkeypatch.setattr(Trainer, "train_step", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        main(["train", "--resume", str(finished_run), "--train.steps", "5"])


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_keeps_the_last_one(finished_run, capsys, monkeypatch):
    """A full disk surfaces from torch.save as an opaque write error: the line says what the save
    needed and had, the partial directory is gone, the complete checkpoint untouched."""
    import torch.distributed.checkpoint as dcp

    def full_disk(state, checkpoint_id):
        Path(checkpoint_id).mkdir(parents=True)
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    before = snapshot(finished_run / "checkpoints")
    monkeypatch.setattr(dcp, "save", full_disk)
    line = error_line(capsys, ["train", "--resume", str(finished_run), "--train.steps", "5"])
    checkpoints = finished_run / "checkpoints"
    failed = f"moefold: error: saving checkpoint {checkpoints / 'step_00000005'} failed (RuntimeError: "
    assert line.startswith(failed), line
    assert re.search(r"this rank's tensors take [\d.]+ MiB, [\d,.]+ MiB free\); the latest complete checkpoint, "
                     r"step_00000003, is intact$", line), line
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000003"]
    assert snapshot(checkpoints) == before


class _DiskFillsMidRecord:
    """metrics.jsonl's file on a disk that takes half of the next write, then refuses."""

    def __init__(self, file):
        self.file, self.calls = file, 0

    def write(self, data):
        self.calls += 1
        if self.calls > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.file.write(bytes(data[: len(data) // 2]))

    def __getattr__(self, name):
        return getattr(self.file, name)


def test_metrics_on_a_full_disk_keep_whole_records_and_say_so_in_one_line(finished_run, capsys, monkeypatch):
    from moefold.train.metrics import MetricsSinks

    sinks = MetricsSinks(finished_run, tensorboard=False)
    before = (finished_run / "metrics.jsonl").read_bytes()
    sinks.jsonl = _DiskFillsMidRecord(sinks.jsonl)
    with pytest.raises(OSError) as raised:
        sinks.write({"step": 99, "loss": 1.0})
    sinks.close()
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(finished_run / "metrics.jsonl")
    assert (finished_run / "metrics.jsonl").read_bytes() == before  # the half record undone

    def full(self, record):
        raise OSError(errno.ENOSPC, "No space left on device", str(finished_run / "metrics.jsonl"))
    monkeypatch.setattr(MetricsSinks, "write", full)
    line = error_line(capsys, ["train", "--resume", str(finished_run), "--train.steps", "5"])
    assert line == (f"moefold: error: writing {finished_run / 'metrics.jsonl'}: No space left on device; "
                    "free space (or choose another directory) and run again")


def test_a_token_id_beyond_the_vocabulary_past_the_startup_check_stops_training_in_one_line(
        tmp_path, monkeypatch, capsys):
    """The startup check reads each token file's head; an id further on stops the run when its
    batch is made (a DataError, exit 2), not as an embedding IndexError (a device assert on GPU)."""
    import numpy as np

    from conftest import TINY_OVERRIDES, cli_args
    from moefold.data import corpus

    monkeypatch.setattr(corpus, "_VOCAB_CHECK_TOKENS", 64)
    tokens_N = np.arange(4096, dtype=np.uint16) % 256
    tokens_N[2000:] = 5000
    np.save(tmp_path / "tokens.npy", tokens_N)
    overrides = {**TINY_OVERRIDES, "data.path": str(tmp_path / "tokens.npy"), "data.val_fraction": "0"}
    line = error_line(capsys, ["train", "--run-dir", str(tmp_path / "run"), *cli_args(overrides)])
    assert "token id 5000 in a training batch is outside the vocabulary [0, 257)" in line


@pytest.fixture(scope="module")
def deepseek_run(tmp_path_factory):
    """A finished tiny DeepSeek run: an MTP module, expert bias, an untied head."""
    from conftest import write_text_corpus

    root = tmp_path_factory.mktemp("deepseek")
    run = root / "run"
    assert main(["train", "--config", "tiny-deepseek", "--run-dir", str(run), "--data.path",
                 str(write_text_corpus(root / "corpus")), "--train.steps", "2", "--train.warmup_steps", "0",
                 "--train.seq_len", "32", "--train.micro_batch_size", "2", "--train.device", "cpu",
                 "--logging.progress_bar", "false", "--logging.tensorboard", "false"]) == 0
    return run


@pytest.mark.parametrize("change, expected", [
    (["--model.mtp_layers", "0"], "holds mtp.layers.0."),
    (["--model.mtp_layers", "2"], "this model holds mtp.layers.1."),
    (["--moe.expert_bias", "false"], "holds layers.1.ffn.router.expert_bias_E"),
    (["--model.tie_embeddings", "true"], "model.tie_embeddings=True, but"),
])
def test_a_resume_that_changes_the_models_tensors_is_refused(deepseek_run, tmp_path, capsys, change, expected):
    """Tensors the checkpoint holds and the model lacks (or the reverse) are refused by name, never
    dropped silently or reported as a corrupt checkpoint; a tied head, one line, not a traceback."""
    line = error_line(capsys, ["train", "--resume", str(deepseek_run), "--run-dir", str(tmp_path / "again"),
                               "--train.steps", "3", *change])
    assert expected in line and line.endswith("a run continues with the model.* and moe.* it was trained with")


def test_a_config_changed_in_python_is_checked_by_the_trainer(tmp_path):
    from moefold.config import load_config
    from moefold.errors import ConfigError
    from moefold.train.trainer import Trainer

    cfg = load_config("tiny")
    cfg.moe.top_k = 100
    with pytest.raises(ConfigError, match=r"^moe\.top_k=100 exceeds moe\.num_experts="):
        Trainer(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()
