"""End-to-end training runs on a tiny model: metrics, exact resume, signals, atomic checkpoints."""

import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import TINY_OVERRIDES, run_cli, run_cli_interrupted
from moefold.checkpoint.dcp import complete_checkpoints, latest_checkpoint
from moefold.cli import main
from moefold.data import IGNORE_INDEX


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def test_training_writes_metrics_and_learns(tmp_path, tiny_args):
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "30",
                 "--train.val_every", "15", "--train.lr", "1e-2"]) == 0
    records = read_metrics(run)
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in train] == list(range(1, 31))
    assert [r["step"] for r in val] == [15, 30]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "tflops", "load_imbalance", "aux_loss"):
        assert all(key in r for r in train), key
    assert train[-1]["loss"] < train[0]["loss"] - 1.0
    assert val[-1]["val_loss"] < 4.0
    assert all(r["load_imbalance"] >= 1.0 for r in train)
    assert latest_checkpoint(run).name == "step_00000030"


@pytest.mark.parametrize("features", [
    [],
    ["--moe.score_func", "sigmoid", "--moe.expert_bias", "--moe.global_aux_loss_coeff", "0.01",
     "--moe.seq_aux_loss_coeff", "0.01", "--moe.z_loss_coeff", "0.001", "--moe.shared_experts", "1",
     "--moe.capacity_factor", "1.0", "--moe.input_jitter", "0.01"],
    ["--optim.exp_avg_dtype", "fp8", "--optim.exp_avg_sq_dtype", "bf16",
     "--optim.master_dtype", "bf16+remainder"],
], ids=["default", "sigmoid-bias-capacity-shared", "fp8-moments-bf16-master"])
def test_resume_reproduces_uninterrupted_losses_exactly(tmp_path, tiny_args, features):
    full = tmp_path / "full"
    assert main(["train", "--run-dir", str(full), *tiny_args, *features, "--checkpoint.every", "5",
                 "--checkpoint.keep", "5", "--train.grad_accum", "2"]) == 0
    resumed = tmp_path / "resumed"
    step5 = full / "checkpoints" / "step_00000005"
    assert main(["train", "--resume", str(step5), "--run-dir", str(resumed)]) == 0
    expected = train_losses(full)
    got = train_losses(resumed)
    assert sorted(got) == list(range(6, 13))
    assert all(got[s] == expected[s] for s in got), (got, expected)


def test_resume_trains_with_the_hyperparameters_given(tmp_path, tiny_args):
    """--train.lr, betas, eps and weight decay given at resume apply (torch's loads would put the
    saved ones back): after the resume, the lr is what a run with the new train.lr has at that step."""
    from moefold.config import config_from_toml
    from moefold.train.trainer import Trainer

    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--checkpoint.every", "6"]) == 0
    fresh = tmp_path / "fresh"
    assert main(["train", "--run-dir", str(fresh), *tiny_args, "--train.lr", "1e-4"]) == 0
    step6 = run / "checkpoints" / "step_00000006"
    resumed = tmp_path / "resumed"
    assert main(["train", "--resume", str(step6), "--run-dir", str(resumed), "--train.lr", "1e-4"]) == 0
    lrs, fresh_lrs = ({r["step"]: r["lr"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
                       if "lr" in r} for d in (resumed, fresh))
    assert lrs == {s: fresh_lrs[s] for s in range(7, 13)} and lrs[7] < 1e-4

    cfg = config_from_toml(run / "config.toml", {"train.beta1": "0.5", "train.beta2": "0.75", "train.eps": "1e-6",
                                                 "train.weight_decay": "0.25", "train.steps": "13"})
    trainer = Trainer(cfg, tmp_path / "again", resume=step6, out=lambda line: None)
    groups = trainer.optimizer.param_groups
    assert [(g["betas"], g["eps"]) for g in groups] == [((0.5, 0.75), 1e-6)] * len(groups)
    assert sorted({g["weight_decay"] for g in groups}) == [0.0, 0.25]  # matrices decay, the rest not


@pytest.mark.parametrize("key, value, held", [("exp_avg_dtype", "bf16", "fp32"), ("master_dtype", "bf16", "fp32"),
                                             ("exp_avg_sq_dtype", "fp32", "bf16")])
def test_resume_refuses_other_optimizer_state_dtypes(tmp_path, tiny_args, capsys, key, value, held):
    """The states resume as saved: another dtype is refused by name (it read as a corrupt checkpoint)."""
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "2", "--train.warmup_steps", "1",
                 "--optim.exp_avg_sq_dtype", "bf16" if held == "bf16" else "fp32"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--train.steps", "4", f"--optim.{key}", value]) == 2
    checkpoint = run / "checkpoints" / "step_00000002"
    assert capsys.readouterr().err.splitlines() == [
        f"moefold: error: optim.{key}='{value}', but {checkpoint} holds the optimizer states of optim.{key}='{held}': "
        f"a run resumes with the states it saved; keep optim.{key}"]


def test_resume_and_generate_read_the_checkpoint_metadata_once(tmp_path, tiny_args, monkeypatch):
    """`.metadata` lists every chunk of every saved tensor (large for a large job, and every rank
    reads it): the checks before a load and DCP's load share one read."""
    import torch.distributed.checkpoint as dcp

    from moefold.generate import load_model_from_run

    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "4", "--train.warmup_steps", "1",
                 "--checkpoint.every", "2"]) == 0
    reads = []
    read_metadata = dcp.FileSystemReader.read_metadata
    monkeypatch.setattr(dcp.FileSystemReader, "read_metadata",
                        lambda self, *a, **k: reads.append(self.path) or read_metadata(self, *a, **k))
    step2 = run / "checkpoints" / "step_00000002"
    assert main(["train", "--resume", str(step2), "--run-dir", str(tmp_path / "resumed")]) == 0
    assert len(reads) == 1, reads
    load_model_from_run(run)
    assert len(reads) == 2, reads


def test_sigterm_saves_then_resume_matches_uninterrupted(tmp_path, tiny_args):
    reference = tmp_path / "reference"
    args = [*tiny_args, "--train.steps", "400"]
    assert main(["train", "--run-dir", str(reference), *args]) == 0

    run = tmp_path / "interrupted"
    result = run_cli_interrupted(["train", "--run-dir", str(run), *args], run)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    assert "interrupted by SIGTERM" in result.stderr and "Traceback" not in result.stderr
    assert "moefold: SIGTERM received; stopping after this step with a checkpoint" in result.stderr
    stopped_at = complete_checkpoints(run)[-1][0]
    assert 3 <= stopped_at < 400

    assert main(["train", "--resume", str(run)]) == 0
    expected, got = train_losses(reference), train_losses(run)
    assert all(got[s] == expected[s] for s in range(1, 401)), "resumed losses differ"


_CRASHING_SAVE = """
import os, signal, sys
from pathlib import Path
import moefold.checkpoint.dcp as ckpt
real_save = ckpt.dcp.save
def dying_save(state, checkpoint_id):
    real_save(state, checkpoint_id=checkpoint_id)
    shard = next(Path(checkpoint_id).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])      # half-written shard ...
    os.kill(os.getpid(), signal.SIGKILL)             # ... and the process dies mid-save
ckpt.dcp.save = dying_save
from moefold.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_save_killed_halfway_leaves_previous_checkpoint_loadable(tmp_path, tiny_args):
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "4"]) == 0
    before = {p: p.read_bytes() for p in (run / "checkpoints").rglob("*") if p.is_file()}

    crashed = subprocess.run([sys.executable, "-c", _CRASHING_SAVE, "train", "--resume", str(run),
                              "--train.steps", "8"], capture_output=True, text=True)
    assert crashed.returncode == -signal.SIGKILL
    assert (run / "checkpoints" / "step_00000008.tmp").exists()
    assert latest_checkpoint(run).name == "step_00000004"
    assert all(p.read_bytes() == data for p, data in before.items())

    assert main(["train", "--resume", str(run), "--train.steps", "8"]) == 0
    assert latest_checkpoint(run).name == "step_00000008"
    assert not (run / "checkpoints" / "step_00000008.tmp").exists()


@pytest.mark.parametrize("log_every, steps", [(1, "step 2"), (4, "step 2")])  # a checkpoint ends a log window
def test_a_diverged_run_stops_before_saving_non_finite_weights(tmp_path, tiny_args, capsys, log_every, steps):
    """lr 1e30, without weight decay (that would flip every weight's sign, which is refused):
    step 1's update makes step 2's gradient norm nan. The run stops there, at a log step or before
    the save due at step 2 (which logs the window since step 1's save first), with one line; the checkpoint of step 1 stays the latest (rotation
    would otherwise have deleted it for nan weights)."""
    from moefold.generate import load_model_from_run

    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.lr", "1e30", "--train.weight_decay", "0",
                 "--train.warmup_steps", "1", "--checkpoint.every", "1", "--checkpoint.keep", "1",
                 "--logging.log_every", str(log_every)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"moefold: error: training diverged: the gradient norm was nan within {steps}, which leaves the weights "
        "non-finite; nothing from these steps is saved. Lower train.lr (now 1e+30) or raise "
        "train.warmup_steps, then resume from the last checkpoint"]
    assert [step for step, _ in complete_checkpoints(run)] == [1]
    model, _, _ = load_model_from_run(run, "cpu")
    assert all(p.isfinite().all() for p in model.parameters())


def test_moe_metrics_reach_the_log(tmp_path, tiny_args):
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "4",
                 "--moe.capacity_factor", "0.5", "--moe.z_loss_coeff", "0.001",
                 "--moe.seq_aux_loss_coeff", "0.01"]) == 0
    last = [r for r in read_metrics(run) if "loss" in r][-1]
    for key in ("aux_loss", "seq_aux_loss", "z_loss", "load_cv", "dead_expert_fraction",
                "routing_entropy", "aux_loss_per_layer", "load_imbalance_per_layer"):
        assert key in last, key
    assert 0 < last["dropped_fraction"] < 1  # capacity 0.5 must drop about half the copies


def test_expert_load_heatmap_is_written_at_the_end(tmp_path, tiny_args):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "3",
                 "--logging.expert_load_heatmap", "true"]) == 0
    assert (run / "expert_load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_generate_samples_from_latest_checkpoint(tmp_path, tiny_args, capsys):
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args]) == 0
    capsys.readouterr()
    gen = ["generate", "--run-dir", str(run), "--prompt", "document 3:", "--max-new-tokens", "16"]
    assert main(gen) == 0
    first = capsys.readouterr().out
    assert main(gen) == 0
    assert first.startswith("document 3:") and len(first) > len("document 3:")
    assert capsys.readouterr().out == first  # same seed, same sample


def test_cli_process_exit_code_and_one_line_error(tmp_path):
    result = run_cli(["train", "--moe.top_k", "9"], cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == "moefold: error: moe.top_k=9 exceeds moe.num_experts=8"
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("master", ["fp32", "bf16", "bf16+remainder"])
def test_weights_only_checkpoint_is_what_the_masters_start_from(tmp_path, text_corpus, master):
    """A weights-only checkpoint (what `moefold convert --from-hf` writes) is loaded before the
    optimizer exists: its masters are the checkpoint's fp32 weights (rounded, for bf16 masters),
    not a remainder left over from weights drawn and then overwritten."""
    import torch

    from moefold.checkpoint.dcp import save_weights_only
    from moefold.config import load_config, to_toml
    from moefold.models.transformer import build_model
    from moefold.train.trainer import Trainer

    cfg = load_config("tiny", {**TINY_OVERRIDES, "data.path": str(text_corpus), "optim.master_dtype": master})
    converted = build_model(cfg, vocab_size=257)
    converted.init_weights(cfg.train.seed + 1)  # not what the run's seed draws
    weights = tmp_path / "converted"
    save_weights_only(converted.state_dict(), weights)
    (weights / "config.toml").write_text(to_toml(cfg))
    trainer = Trainer(cfg, tmp_path / "run", resume=weights, out=lambda line: None)
    for name, p in trainer.model.named_parameters():
        expected = dict(converted.named_parameters())[name].detach()
        if master == "bf16":
            expected = expected.bfloat16()
        got = p.detach() if master == "fp32" else trainer.optimizer._load_master(p, trainer.optimizer.state[p])
        assert torch.equal(got, expected.float()), name


def test_validation_and_saving_stay_out_of_tokens_per_s(tmp_path, tiny_args, monkeypatch):
    """On a clock that only training steps (1 s each), validation and saves (1000 s each) move,
    every log window reports its tokens over its training seconds alone, including the windows
    a validation or a save falls into (val_every and checkpoint.every are not multiples of
    log_every here; the save at step 3 ends a window, and the validation and save there fall into
    the next)."""
    import types

    import moefold.train.trainer as trainer_module
    from moefold.train.trainer import Trainer

    clock = [0.0]
    monkeypatch.setattr(trainer_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def advancing(method, seconds):
        def run(self, *args, **kwargs):
            out = method(self, *args, **kwargs)
            clock[0] += seconds
            return out
        return run

    monkeypatch.setattr(Trainer, "train_step", advancing(Trainer.train_step, 1.0))
    monkeypatch.setattr(Trainer, "_log_validation", advancing(Trainer._log_validation, 1000.0))
    monkeypatch.setattr(Trainer, "save", advancing(Trainer.save, 1000.0))
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "6",
                 "--logging.log_every", "2", "--train.val_every", "3", "--checkpoint.every", "3"]) == 0
    train = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in train] == [2, 3, 4, 6]
    tokens_per_step = 4 * 32  # micro_batch_size · seq_len of TINY_OVERRIDES
    assert [r["tokens_per_s"] for r in train] == [tokens_per_step] * 4


def test_metrics_jsonl_is_strict_json_when_values_are_not_finite(tmp_path):
    """A diverging run's nan and inf are written as null: Python's bare NaN is not JSON."""
    from moefold.train.metrics import MetricsSinks

    sinks = MetricsSinks(tmp_path, tensorboard=False)
    sinks.write({"step": 3, "loss": float("nan"), "grad_norm": float("inf"),
                 "aux_loss_per_layer": [1.5, float("-inf")], "lr": 1e-3})
    sinks.close()

    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    record = json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=refuse)
    assert record == {"step": 3, "loss": None, "grad_norm": None, "aux_loss_per_layer": [1.5, None],
                      "lr": 1e-3}


def test_resuming_a_finished_run_says_so_and_writes_nothing(tmp_path, tiny_args, capsys):
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "3"]) == 0
    checkpoint = latest_checkpoint(run)
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["train", "--resume", str(run)]) == 0
    out = capsys.readouterr().out
    assert "nothing to train: the run is already at step 3 = train.steps" in out
    assert latest_checkpoint(run) == checkpoint
    rewritten = ("config.toml", ".lock")  # its config and who holds the run directory
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()
            if p.name not in rewritten} == {p: t for p, t in before.items() if p.name not in rewritten}


def test_a_run_started_with_relative_data_paths_is_used_from_anywhere(tmp_path, text_corpus, monkeypatch):
    """config.toml records data.path and data.tokenizer absolute: `generate` and `--resume` from
    another working directory find them."""
    from conftest import cli_args
    from test_data import write_hf_tokenizer

    tokenizer = write_hf_tokenizer(tmp_path / "tokenizer.json")
    monkeypatch.chdir(tmp_path)
    overrides = {**TINY_OVERRIDES, "data.path": text_corpus.name, "data.tokenizer": tokenizer.name,
                 "train.steps": "2", "train.warmup_steps": "0"}
    assert main(["train", "--run-dir", "run", *cli_args(overrides)]) == 0
    config = (tmp_path / "run" / "config.toml").read_text()
    assert f'path = "{text_corpus}"' in config and f'tokenizer = "{tokenizer}"' in config
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    run = str(tmp_path / "run")
    assert main(["generate", "--run-dir", run, "--prompt", "hello", "--max-new-tokens", "2"]) == 0
    assert main(["train", "--resume", run, "--train.steps", "3"]) == 0


def test_the_expert_load_history_continues_across_a_resume(tmp_path, text_corpus):
    """The heatmap's windows are checkpointed: a run resumed from step 4 has the windows before
    it, and ends with the uninterrupted run's history (and so its expert_load.png)."""
    from moefold.config import load_config
    from moefold.train.trainer import Trainer

    cfg = load_config(None, {**TINY_OVERRIDES, "data.path": str(text_corpus), "train.steps": "6",
                             "logging.log_every": "2", "checkpoint.every": "4"})
    whole = Trainer(cfg, tmp_path / "whole", out=lambda line: None)
    whole.fit()
    resumed = Trainer(cfg, tmp_path / "resumed", resume=tmp_path / "whole/checkpoints/step_00000004",
                      out=lambda line: None)
    assert [step for step, _ in resumed.load_history] == [2, 4]
    resumed.fit()
    assert [step for step, _ in whole.load_history] == [2, 4, 6]
    assert resumed.load_history == whole.load_history


def test_a_one_window_heatmap_labels_its_step_once():
    from moefold.train.heatmap import _step_at

    assert [_step_at([8], x) for x in (-0.4, -0.2, 0.0, 0.2, 0.4)] == ["", "", "8", "", ""]
    assert [_step_at([2, 4, 6], x) for x in (0, 1, 2, 3)] == ["2", "4", "6", ""]


def test_an_fp8_run_whose_exclusions_keep_every_module_says_it_is_not_fp8(tmp_path, tiny_args, capsys):
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "1", "--train.warmup_steps", "0",
                 "--precision.fp8", "rowwise", "--precision.fp8_exclude", '["*"]']) == 0
    assert "warning: precision.fp8=rowwise converts no module" in capsys.readouterr().out
    assert main(["train", "--run-dir", str(tmp_path / "fp8"), *tiny_args, "--train.steps", "1",
                 "--train.warmup_steps", "0", "--precision.fp8", "rowwise"]) == 0
    assert "converts no module" not in capsys.readouterr().out


def test_global_batch_size_sets_the_micro_batches_per_step(tmp_path, tiny_args, capsys):
    """train.global_batch_size = 2 · micro_batch_size trains as train.grad_accum 2 does (the
    planner takes the same count, config.micro_batches_per_step); one not divisible is refused."""
    runs = {}
    for name, option in (("accum", ["--train.grad_accum", "2"]), ("global", ["--train.global_batch_size", "8"])):
        runs[name] = tmp_path / name
        assert main(["train", "--run-dir", str(runs[name]), *tiny_args, "--train.steps", "3", *option]) == 0
    assert train_losses(runs["global"]) == train_losses(runs["accum"])
    capsys.readouterr()
    assert main(["train", "--run-dir", str(tmp_path / "bad"), *tiny_args, "--train.global_batch_size", "6"]) == 2
    assert "train.global_batch_size=6 is not divisible by train.micro_batch_size · dp = 4 · 1" in capsys.readouterr().err


def test_validation_weights_each_batch_by_its_real_labels(tmp_path, text_corpus):
    """Labels of IGNORE_INDEX count in neither the loss nor its weight: the validation loss is the
    mean over every real label of all batches (an independent sum of per-token losses), not each
    batch's mean weighted by its size."""
    import dataclasses

    import torch.nn.functional as F

    from moefold.config import load_config
    from moefold.train.trainer import Trainer

    cfg = load_config(None, {**TINY_OVERRIDES, "data.path": str(text_corpus), "train.steps": "1",
                             "train.warmup_steps": "0", "train.val_batches": "2"})
    trainer = Trainer(cfg, tmp_path / "run", out=lambda line: None)
    first, second = trainer.val_batches[:2]
    labels_BS = second.labels_BS.clone()
    labels_BS[:, labels_BS.shape[1] // 4:] = IGNORE_INDEX  # three quarters of the second batch ignored
    trainer.val_batches = [first, dataclasses.replace(second, labels_BS=labels_BS)]
    with torch.no_grad():
        trainer.model.eval()
        per_token = [F.cross_entropy(trainer.model(b.input_ids_BS).flatten(0, 1).double(),
                                     b.labels_BS.flatten(), reduction="none", ignore_index=IGNORE_INDEX)
                     for b in trainer.val_batches]
        expected = torch.cat(per_token).sum() / sum((b.labels_BS != IGNORE_INDEX).sum() for b in trainer.val_batches)
    assert trainer.validate() == pytest.approx(expected.item(), rel=1e-5)


def test_a_validation_batch_with_every_label_ignored_adds_nothing(tmp_path, text_corpus):
    """Its mean loss is nan (a mean over no tokens), and nan · 0 tokens made the whole validation
    loss nan: it is the loss of the other batches, as if it were not there."""
    import dataclasses

    from moefold.config import load_config
    from moefold.train.trainer import Trainer

    cfg = load_config(None, {**TINY_OVERRIDES, "data.path": str(text_corpus), "train.steps": "1",
                             "train.warmup_steps": "0", "train.val_batches": "2"})
    trainer = Trainer(cfg, tmp_path / "run", out=lambda line: None)
    first, second = trainer.val_batches[:2]
    trainer.val_batches = [first]
    without = trainer.validate()
    ignored = dataclasses.replace(second, labels_BS=torch.full_like(second.labels_BS, IGNORE_INDEX))
    trainer.val_batches = [first, ignored]
    assert math.isfinite(without)
    assert trainer.validate() == without


def test_validation_without_a_single_label_is_nan_and_said_when_the_run_starts(tmp_path, text_corpus):
    """Every validation label IGNORE_INDEX (a mean over no tokens) divided by zero tokens: a
    ZeroDivisionError traceback at the first validation. The loss is nan (null in metrics.jsonl),
    the run says why as it starts, and it trains on: validation measures, it does not steer."""
    import dataclasses

    from moefold.config import load_config
    from moefold.train.trainer import Trainer

    cfg = load_config(None, {**TINY_OVERRIDES, "data.path": str(text_corpus), "train.steps": "2",
                             "train.warmup_steps": "0", "train.val_every": "1"})
    said = []
    trainer = Trainer(cfg, tmp_path / "run", out=said.append)
    trainer.val_batches = [dataclasses.replace(b, labels_BS=torch.full_like(b.labels_BS, IGNORE_INDEX))
                           for b in trainer.val_batches]
    assert math.isnan(trainer.validate())
    assert math.isnan(trainer.fit()["val_loss"])
    assert said.count("warning: no validation token has a label (every label is -100): val_loss is nan "
                      "(null in metrics.jsonl)") == 1
    assert [(r["step"], r["val_loss"]) for r in read_metrics(tmp_path / "run") if "val_loss" in r] == [
        (1, None), (2, None)]
    assert latest_checkpoint(tmp_path / "run").name == "step_00000002"
