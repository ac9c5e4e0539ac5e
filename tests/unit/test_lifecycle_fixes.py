"""A run's lifecycle across a resume, and what it logs: the records a resumed run logs again, the
global batch of a resume under another batch layout, a tied head untied on resume, deep copies of a
compiled model, and the validation set's sequences."""

import copy
import functools
import json
from pathlib import Path

import pytest
import torch

from moefold.cli import main
from moefold.config import load_config
from moefold.models.transformer import build_model
from moefold.train.compile import compile_blocks
from test_bad_input import error_line

# ------------------------------------------------------------------------ metrics.jsonl after a resume


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def _steps(lines: list[str]) -> list[tuple[int, str]]:
    return [(json.loads(line)["step"], "val" if "val_loss" in json.loads(line) else "log") for line in lines]


def _run_killed_after_its_last_checkpoint(tmp_path, tiny_args) -> Path:
    """A run that logged steps 1-6 (validation at 3 and 6) and saved at 3, as if killed at step 6
    before its next save."""
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "6", "--checkpoint.every", "3",
                 "--checkpoint.keep", "2", "--train.val_every", "3"]) == 0
    for path in (run / "checkpoints" / "step_00000006").iterdir():
        path.unlink()
    (run / "checkpoints" / "step_00000006").rmdir()
    return run


def test_a_resumed_run_moves_the_records_it_logs_again_to_a_side_file(tmp_path, tiny_args, capsys):
    """Steps 4-6, logged by the run before it was killed and again by the resumed one, were in
    metrics.jsonl twice (steps 1-6 then 4-8), so a reader plotting it drew two curves over them.
    The resumed run's records supersede them, as TensorBoard's purge_step does: metrics.jsonl
    holds each step once, and the earlier records, byte for byte, are in
    metrics.superseded.jsonl beside it (nothing already written is lost)."""
    run = _run_killed_after_its_last_checkpoint(tmp_path, tiny_args)
    before = _lines(run / "metrics.jsonl")
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--train.steps", "8", "--train.val_every", "3"]) == 0
    out = capsys.readouterr().out
    after = _lines(run / "metrics.jsonl")
    assert _steps(after) == [(1, "log"), (2, "log"), (3, "log"), (3, "val"), (4, "log"), (5, "log"),
                             (6, "log"), (6, "val"), (7, "log"), (8, "log"), (8, "val")]
    assert after[:4] == before[:4]
    superseded = _lines(run / "metrics.superseded.jsonl")
    assert superseded == before[4:] and _steps(superseded) == [(4, "log"), (5, "log"), (6, "log"), (6, "val")]
    assert "metrics.superseded.jsonl" in out and "steps 4–6" in out
    # A second resume, from step 6: the superseded file keeps both earlier histories.
    for path in (run / "checkpoints" / "step_00000008").iterdir():
        path.unlink()
    (run / "checkpoints" / "step_00000008").rmdir()
    assert main(["train", "--resume", str(run), "--train.steps", "9"]) == 0
    assert _lines(run / "metrics.superseded.jsonl") == before[4:] + after[8:]
    assert _steps(_lines(run / "metrics.jsonl")) == [*_steps(after[:8]), (7, "log"), (8, "log"), (9, "log"),
                                                     (9, "val")]


def test_a_resume_without_later_records_moves_nothing(tmp_path, tiny_args):
    """Killed right after its checkpoint: nothing superseded, no side file."""
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "3"]) == 0
    assert main(["train", "--resume", str(run), "--train.steps", "4"]) == 0
    assert [step for step, _ in _steps(_lines(run / "metrics.jsonl"))] == [1, 2, 3, 3, 4, 4]  # val at the end
    assert not (run / "metrics.superseded.jsonl").exists()
def test_the_records_superseded_are_found_at_the_end_of_a_long_file(tmp_path):
    """metrics.jsonl holds the whole run's records, read backwards a block at a time: 5,000 records
    (about 600 kB), of which the last 12 are superseded (two records at step 4990)."""
    from moefold.train.metrics import MetricsSinks

    records = [json.dumps({"step": step, "loss": 1.0, "note": "x" * 100}) for step in range(1, 5001)]
    records.insert(4990, json.dumps({"step": 4990, "val_loss": 2.0}))
    (tmp_path / "metrics.jsonl").write_text("".join(line + "\n" for line in records))
    said = []
    MetricsSinks(tmp_path, tensorboard=False, out=said.append, first_step=4990).close()
    assert _lines(tmp_path / "metrics.jsonl") == records[:4989]
    assert _lines(tmp_path / "metrics.superseded.jsonl") == records[4989:]
    assert said == [f"{tmp_path / 'metrics.jsonl'}: moved the records of steps 4990–5000, logged after the "
                    f"checkpoint this run resumes from, to {tmp_path / 'metrics.superseded.jsonl'}: this run "
                    "logs them again"]


# ------------------------------------------------------------------------ untying a tied run's full checkpoint

def test_untying_a_tied_runs_full_checkpoint_is_refused_naming_the_option(tmp_path, tiny_args, capsys):
    """A tied run's optimizer holds one state for the embedding and the head together; resumed
    with --model.tie_embeddings false it was refused as 'checkpoint ... is unreadable or corrupt:
    RuntimeError: Missing key in checkpoint state_dict: optim.state.output.weight.step', which
    blames the file and names no option."""
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "2", "--model.tie_embeddings",
                 "true"]) == 0
    checkpoint = run / "checkpoints" / "step_00000002"
    line = error_line(capsys, ["train", "--resume", str(run), "--train.steps", "3", "--model.tie_embeddings",
                               "false"])
    assert line == (f"moefold: error: model.tie_embeddings=False, but {checkpoint} was saved by a run with "
                    "model.tie_embeddings=True, whose optimizer holds one state for the embedding and the output "
                    "head together: a run continues with the model.* and moe.* it was trained with; keep "
                    "model.tie_embeddings=True")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [checkpoint.name]


# ------------------------------------------------------------------------ deep copies of a compiled model

def test_a_model_with_compiled_blocks_is_not_deep_copied_into_the_original(monkeypatch):
    """compile_blocks sets each block's forward to torch.compile of its bound method, an instance
    attribute that copy.deepcopy keeps as it is: the copy (an EMA, torch's AveragedModel, a
    reference model) ran the original's blocks (its own blocks' weights + 1 changed no output) and
    its backward trained the original's, silently. Refused in one line, as memory.recompute's are."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    cfg = load_config("tiny", {"model.n_layers": "2", "model.dim": "32", "model.n_heads": "2",
                               "model.n_kv_heads": "1"})
    model = build_model(cfg, 64)
    compile_blocks(model)
    for module in (model, model.layers[1]):
        with pytest.raises(TypeError, match=r"^cannot deep-copy a model built with train\.compile: "):
            copy.deepcopy(module)


# ------------------------------------------------------------------------ the global batch of a resume

def test_a_resume_with_another_global_batch_says_so_in_one_note(tmp_path, tiny_args, capsys):
    """A resume keeps train.micro_batch_size per data rank, so on other data ranks (or with another
    micro_batch_size or grad_accum) the tokens per optimizer step changed without a word. One note
    names the saved and the new global batch, and how to keep the saved one; none when it is kept."""
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "2"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--train.steps", "3", "--train.micro_batch_size", "2"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    assert notes == ["note: the checkpoint's run trained 4 sequences (128 tokens) per optimizer step, this run "
                     "trains 2 (64 tokens): train.micro_batch_size · data-parallel ranks · grad_accum = 2 · 1 · 1; "
                     "train.global_batch_size=4 keeps the saved one"]
    assert main(["train", "--resume", str(run), "--train.steps", "4", "--train.micro_batch_size", "1",
                 "--train.grad_accum", "2"]) == 0
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]


# ------------------------------------------------------------------------ the validation set on data ranks

@pytest.mark.parametrize("num_sequences, batch_size, num_batches, data_ranks, expected", [
    (20, 2, 3, 1, [[0, 1], [2, 3], [4, 5]]),
    (20, 2, 3, 2, [[0, 1, 2, 3], [4, 5]]),  # was [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    (20, 2, 4, 4, [[0, 1, 2, 3, 4, 5, 6, 7]]),
    (5, 2, 8, 2, [[0, 1, 2, 3]]),  # small: whole micro-batches, no sequence twice
    (3, 4, 8, 2, [[0, 1, 2]]),  # fewer than a micro-batch: one batch of all
])
def test_the_validation_sequences_do_not_depend_on_the_data_ranks(num_sequences, batch_size, num_batches,
                                                                  data_ranks, expected):
    """The trainer passed val_batches the global micro-batch (micro_batch_size · dp), so the same
    config validated dp times more sequences on dp data ranks; the batches now hold micro_batch_size
    rows per data rank out of the same first val_batches · micro_batch_size sequences."""
    import numpy as np

    from moefold.data.loader import PackedSequences, val_batches

    sequences = PackedSequences(np.arange(num_sequences * 4 + 1), 4)
    batches = val_batches(sequences, batch_size, num_batches, eos_id=-1, data_ranks=data_ranks)
    assert [(b.input_ids_BS[:, 0] // 4).tolist() for b in batches] == expected


# ------------------------------------------------------------------------ model options a resume changes

def test_a_resume_that_changes_the_model_says_so_in_one_note(tmp_path, tiny_args, capsys):
    """`train --resume RUN --moe.top_k 3` loads the weights (no shape changes) and trains another
    model than the checkpoint's without a word. One note names each model.*/moe.* value changed,
    old -> new; none when the resume keeps them."""
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "2"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--train.steps", "3", "--moe.top_k", "3",
                 "--moe.aux_loss_coeff", "0.02"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    assert notes == [f"note: this run changes the model it resumes (compared with the config {run}/checkpoints/"
                     "step_00000002 was saved with): moe.top_k 2 -> 3, moe.aux_loss_coeff 0.01 -> 0.02"]
    assert main(["train", "--resume", str(run), "--train.steps", "4"]) == 0  # the saved config.toml has them now
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
