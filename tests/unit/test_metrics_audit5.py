"""The console line, peak memory, the bench's profile and record against what they stand for,
computed here: a window that routed no copy, getrusage's unit on each platform, the bench's
module boundary, capacity per forward, gloo collectives in the CPU profile, tokens per device."""

import ast
import contextlib
import io
import json
import math
import types
from pathlib import Path

import pytest
import torch
from conftest import TINY_OVERRIDES
from memory_runs import one_thread  # noqa: F401 (autouse: ops this small run faster on one thread)
from ranks import run_ranks

from moefold.bench import profile as bench_profile
from moefold.config import load_config
from moefold.moe import stats
from moefold.train import metrics
from moefold.train.trainer import Trainer

SRC = Path(__file__).resolve().parents[2] / "src" / "moefold"


def _record(**moe) -> dict:
    return {"step": 3, "loss": 2.5, "grad_norm": 0.5, "lr": 1e-3, "tokens_per_s": 1000.0, "tflops": 0.001,
            "mfu": None, "peak_mem_gib": 0.5, **moe}


def test_a_window_that_routed_no_copy_prints_no_ratio_of_its_copies():
    """No routed copy (no real token reached an MoE layer): dropped_fraction and load_imbalance
    are nan (null in metrics.jsonl); the console line leaves them out as it leaves out a dropless
    run's 0, where it printed 'dropped nan%' and 'imbalance nan'."""
    zero = {stats.TOKENS: torch.zeros(4, dtype=torch.int64), stats.DROPPED: torch.zeros((), dtype=torch.int64),
            stats.ENTROPY_SUM: torch.zeros(()), stats.ENTROPY_TOKENS: torch.zeros((), dtype=torch.int64)}
    moe = stats.summarize([zero, dict(zero)])
    moe.pop("tokens_per_expert_per_layer")
    assert math.isnan(moe["dropped_fraction"]) and math.isnan(moe["load_imbalance"])
    line = metrics.format_line(_record(**moe), 10)
    assert "nan" not in line and "dropped" not in line and "imbalance" not in line, line
    # a window that routed copies still shows both
    line = metrics.format_line(_record(load_imbalance=1.25, dropped_fraction=0.125), 10)
    assert line.endswith("mem 0.50 GiB | imbalance 1.25 | dropped 12.5%"), line


@pytest.mark.parametrize("platform, maxrss", [("linux", 3 * 2**20), ("darwin", 3 * 2**30)])
def test_peak_cpu_memory_reads_getrusage_in_its_platform_s_unit(monkeypatch, platform, maxrss):
    """ru_maxrss is KiB on Linux and bytes on macOS (getrusage(2) of each): 3 GiB either way."""
    monkeypatch.setattr(metrics.sys, "platform", platform)
    monkeypatch.setattr(metrics.resource, "getrusage", lambda who: types.SimpleNamespace(ru_maxrss=maxrss))
    assert metrics.peak_memory_gib(torch.device("cpu")) == 3.0


def test_bench_imports_no_private_name_of_another_module():
    """The bench's modules use other modules' public names only (limit.py took flops._in_units,
    cli.py metrics._finite_or_null)."""
    private = []
    for path in sorted((SRC / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moefold"):
                private += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert private == []


def _event(name, us, parent=None, is_async=False, self_us=None):
    e = types.SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CPU, cpu_parent=parent,
                              is_async=is_async, cpu_time_total=us,
                              self_cpu_time_total=0.0 if is_async else (us if self_us is None else self_us))
    return e


def test_gloo_collectives_in_a_cpu_profile_are_communication():
    """torch.profiler's events of gloo collectives on the CPU: the c10d op on the calling thread
    (enqueueing, and for a reduce-scatter gloo's copy inside it) and the gloo:<op> event on gloo's
    worker thread, async, whose self time the profiler reports as 0: its duration is the
    collective's time. Both are communication, not "other", and the time counts."""
    rs = _event("c10d::_reduce_scatter_base_", 300.0, self_us=100.0)
    events = [_event("aten::mm", 1000.0), _event("c10d::alltoall_base_", 50.0),
              _event("gloo:all_to_all", 4000.0, is_async=True), _event("c10d::allreduce_", 20.0),
              _event("gloo:all_reduce", 2000.0, is_async=True), rs, _event("aten::copy_", 200.0, parent=rs),
              _event("aten::add", 10.0)]
    timed = bench_profile._cpu_ops(events)
    assert [kind for _, kind, _ in timed] == ["gemm", "comm", "comm", "comm", "comm", "comm", "comm", "other"]
    for name in ("_c10d_functional::all_to_all_single", "_c10d_functional::wait_tensor",
                 "GeneratedBackwardFor__c10d_functional_all_to_all_single_default"):  # FSDP2's, EP's autograd
        assert bench_profile.classify_cpu_op(name) == "comm", name
    b = bench_profile.breakdown(timed, step_us=10_000.0, steps=1)
    assert b["comm_ms"] == pytest.approx((50 + 4000 + 20 + 2000 + 100 + 200) / 1e3)
    assert b["other_ms"] == pytest.approx(0.01) and b["gemm_ms"] == pytest.approx(1.0)
    text = bench_profile.format_profile({**b, "trace": "t.json", "by_name": "b.tsv", "unit": "cpu ops"})
    assert "communication 6.37 ms" in text, text


def _profile_collectives(rank: int, out: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    x_ND = torch.randn(2048, 256)
    y_ND = torch.empty_like(x_ND)

    def step():
        dist.all_to_all_single(y_ND, x_ND)
        dist.all_reduce(y_ND)
        return y_ND @ y_ND.T[:, :64]

    p = bench_profile.profile_steps(step, torch.device("cpu"), 2, out, f"trace-rank{rank}.json")
    rows = [line.split("\t") for line in Path(p["by_name"]).read_text().splitlines()[1:]]
    classes = {name: kind for _, _, kind, name in rows}
    assert classes["gloo:all_to_all"] == classes["gloo:all_reduce"] == "comm", classes
    assert classes["c10d::alltoall_base_"] == classes["c10d::allreduce_"] == "comm", classes
    gloo_ms = sum(float(ms) for ms, _, _, name in rows if name.startswith("gloo:"))
    assert p["comm_ms"] >= gloo_ms > 0


def test_gloo_collectives_of_a_profiled_step_on_two_ranks_are_communication(tmp_path):
    run_ranks(2, _profile_collectives, tmp_path)


def test_bench_tokens_per_device_are_not_rounded_down():
    """tokens_per_s is per device: the job's tokens / world, as training divides; 15 tokens a step
    on tp 2 are 7.5 a device (the record said 7, 7% short)."""
    from moefold.bench.run import _record

    cfg = load_config(None, {**TINY_OVERRIDES, "train.micro_batch_size": "1", "train.seq_len": "15"})
    trainer = types.SimpleNamespace(
        dist=types.SimpleNamespace(world=2, dp_size=1, mean_over_data=lambda t: t), grad_accum=1,
        flops_per_token=1000, peak_tflops=None, device=torch.device("cpu"), compute_dtype=torch.float32,
        vocab_size=257, param_counts=types.SimpleNamespace(main_total=1, main_active=1, mtp=0, mtp_active=0))
    r = _record(cfg, trainer, [0.5], None, {"lm_loss": torch.tensor(5.0)}, torch.tensor(1.0), 1)
    assert r["tokens_per_step"] == 15 and r["tokens"] == 7.5
    assert r["tokens_per_s"] == 15.0 and r["tflops"] == 15.0 * 1000 / 1e12


def test_capacity_is_per_forward_of_a_rank_s_micro_batch(tmp_path, text_corpus, monkeypatch):
    """docs/metrics.md: each forward (a micro-batch of one rank) keeps C = ceil(factor · T·K / E)
    copies per expert of its own T = micro_batch_size · seq_len tokens; the window's dropped_fraction
    is the sum of each forward's drops over the routed copies, counted here from every forward's
    routed counts (grad_accum 2: two forwards a step, each with its own C)."""
    forwards = []  # tokens per expert of each training forward, every MoE layer
    record = stats.ExpertLoadStats.record

    def spy(self, tokens_per_expert_E, *args, **kwargs):
        forwards.append(tokens_per_expert_E.tolist())
        return record(self, tokens_per_expert_E, *args, **kwargs)

    monkeypatch.setattr(stats.ExpertLoadStats, "record", spy)
    cfg = load_config(None, {**TINY_OVERRIDES, "data.path": str(text_corpus), "train.steps": "2",
                             "train.grad_accum": "2", "train.micro_batch_size": "1", "moe.capacity_factor": "1.0",
                             "model.n_layers": "3", "logging.log_every": "2"})
    Trainer(cfg, tmp_path / "run", out=lambda line: None).fit()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    (rec,) = [r for r in map(json.loads, lines) if "loss" in r]
    capacity = math.ceil(1.0 * 1 * cfg.train.seq_len * cfg.moe.top_k / cfg.moe.num_experts)
    assert len(forwards) == 2 * 2 * 2  # steps · micro-batches · MoE layers
    dropped = sum(max(0, c - capacity) for counts in forwards for c in counts)
    assert dropped > 0
    assert rec["dropped_fraction"] == pytest.approx(dropped / sum(map(sum, forwards)), rel=1e-12)


def _drops_config(corpus: Path, micro_batch_size: int, grad_accum: int, **parallel: str):
    return load_config(None, {**TINY_OVERRIDES, "data.path": str(corpus), "train.steps": "1", "train.warmup_steps": "0",
                              "train.micro_batch_size": str(micro_batch_size), "train.grad_accum": str(grad_accum),
                              "moe.capacity_factor": "1.0", "data.val_fraction": "0", "moe.num_experts": "8",
                              "train.seq_len": "8", **{f"parallel.{k}": v for k, v in parallel.items()}})


def _dropped_fraction(run_dir: Path) -> float:
    (record,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return record["dropped_fraction"]


def _fit_ep2(rank: int, corpus: Path, run_dir: Path) -> None:
    Trainer(_drops_config(corpus, 2, 1, ep="2"), run_dir, out=lambda line: None).fit()


def test_ep2_on_two_ranks_drops_what_one_process_drops_at_their_micro_batch_size(tmp_path, text_corpus):
    """docs/metrics.md: capacity is each rank's, of its own micro-batch (Megatron-Core's rule).
    Two ranks (ep 2, each data rank 2 of the global micro-batch's 4 sequences) drop what one process
    drops running those sequences as 2 micro-batches of 2, not what it drops at micro_batch_size 4."""
    run_ranks(2, _fit_ep2, text_corpus, tmp_path / "ep2")
    Trainer(_drops_config(text_corpus, 2, 2), tmp_path / "mbs2", out=lambda line: None).fit()
    Trainer(_drops_config(text_corpus, 4, 1), tmp_path / "mbs4", out=lambda line: None).fit()
    ep2, mbs2, mbs4 = (_dropped_fraction(tmp_path / name) for name in ("ep2", "mbs2", "mbs4"))
    assert ep2 == pytest.approx(mbs2, rel=1e-12) and ep2 > 0
    assert mbs4 < mbs2  # one forward's C of 4 sequences: an expert's busy half borrows from its quiet one


def _bench_on_rank(rank: int, out: Path) -> None:
    from moefold.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["bench", "--config", "tiny-qwen3", "--steps", "1", "--warmup", "0", "--json",
                     str(out / "r.json"), "--train.micro_batch_size", "2", "--train.seq_len", "16"]) == 0
    (out / f"printed{rank}.txt").write_text(printed.getvalue())


def test_bench_s_batch_row_on_two_data_ranks_multiplies_to_its_tokens_per_step(tmp_path):
    """The table's batch row is a product: on 2 data ranks it said '2 × 16 tokens × 1 micro-batch =
    64 tokens per step', leaving out the data ranks its total holds."""
    run_ranks(2, _bench_on_rank, tmp_path)
    record = json.loads((tmp_path / "r.json").read_text())
    row = next(line for line in (tmp_path / "printed0.txt").read_text().splitlines() if line.startswith("batch"))
    factors = [int(n) for n in row.split("=")[0].replace("batch", "").replace(",", "").split() if n.isdigit()]
    assert record["tokens_per_step"] == 64 and math.prod(factors) == 64, row
    assert "× 2 data ranks =" in row
