"""Edge cases of `moefold bench`, its step limit and the FLOP count, on the CPU."""

import pytest
import torch

from memory_runs import one_thread  # noqa: F401  (autouse: one OpenMP thread for tiny ops)
from moefold.bench.limit import step_limit
from moefold.config import load_config
from moefold.train.flops import meta_model, train_flops_per_token

SMALL = {"train.micro_batch_size": "2", "train.seq_len": "16"}


def test_limit_counts_every_micro_batch_of_a_step_and_the_optimizer_once():
    """With train.grad_accum 3 a step runs each kernel 3 times and the optimizer once: the limit
    (and the step FLOPs it divides) is of the whole step, as the step time it is compared with."""
    cfg = load_config("tiny-qwen3", {**SMALL, "train.grad_accum": "3"})
    r = step_limit(cfg, torch.device("cpu"), torch.float32, repeats=1, loss=False, warmup=0)
    one = step_limit(cfg, torch.device("cpu"), torch.float32, repeats=1, loss=False, warmup=0,
                     micro_batches=1, optimizer=False)
    assert r["tokens"] == 3 * one["tokens"] == 3 * 2 * 16
    assert r["step_flops"] == train_flops_per_token(meta_model(cfg), 16) * 3 * 32
    counts = {row["name"]: row["count"] for row in r["rows"]}
    assert [row["count"] for row in r["rows"] if row["optimizer"]] == [1]
    for row in one["rows"]:
        assert counts[row["name"]] == 3 * row["count"], row["name"]
    parts = sum(row["ms"] for row in r["rows"] if row["in_sum"])
    assert r["total_ms"] == pytest.approx(parts)


def test_json_record_of_a_diverged_step_is_strict_json_with_null(tmp_path, capsys):
    """A nan loss (lr 1e30) was written as the bare word NaN, which strict JSON readers (jq, JSON.parse)
    refuse; it is null, as metrics.jsonl writes it, and the printed table keeps nan."""
    import json

    from moefold.cli import main

    path = tmp_path / "r.json"
    assert main(["bench", "--config", "tiny-qwen3", "--steps", "1", "--warmup", "1", "--json", str(path),
                 "--train.micro_batch_size", "2", "--train.seq_len", "16", "--train.lr", "1e30",
                 "--train.weight_decay", "0", "--train.warmup_steps", "0", "--train.grad_clip", "0"]) == 0
    loss_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("loss"))
    assert loss_line.split()[1] == "nan", loss_line

    def refuse(word):
        raise ValueError(f"not JSON: {word}")

    r = json.loads(path.read_text(), parse_constant=refuse)
    assert r["loss"] is None and r["tokens"] == 32


@pytest.mark.parametrize("json_name", ["prof", "prof/trace.json", "prof/by-name.tsv", "prof/trace-rank1.json"])
def test_json_where_the_profile_writes_is_refused_before_the_steps(tmp_path, capsys, json_name):
    """--json naming the --profile directory ended, after the steps, in an IsADirectoryError
    traceback without the record; naming one of its files overwrote the trace or the table."""
    from moefold.cli import main

    capsys.readouterr()
    json_path = tmp_path / json_name
    argv = ["bench", "--config", "tiny", "--steps", "1", "--warmup", "0", "--profile", str(tmp_path / "prof"),
            "--json", str(json_path), "--train.micro_batch_size", "1", "--train.seq_len", "8"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"--json {json_path} is where --profile {tmp_path / 'prof'} writes" in err, err
    assert not (tmp_path / "prof").exists()  # refused before anything ran or was written


def test_limit_under_several_ranks_is_refused_before_the_steps(capsys, monkeypatch):
    """Under torchrun each rank's --limit timed the whole model's kernels (every expert, the
    unsharded projections) against its own share of the step: the fraction printed meant nothing.
    Refused in one line before anything is built."""
    from moefold.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    capsys.readouterr()
    assert main(["bench", "--config", "tiny", "--steps", "1", "--limit"]) == 2
    assert capsys.readouterr().err == (
        "moefold: error: --limit times the whole model's kernels on one device, not a rank's share of them "
        "(WORLD_SIZE=2): run it in one process, without torchrun\n")
