"""FP8 (the CPU emulation) with 'moe_act' in memory.recompute / memory.offload through the real
Trainer: under parallel layouts on gloo ranks and in one process with a checkpoint resume, each
against the same FP8 run without the memory option (same layout, same process count).

apply_fp8 puts FP8 experts in the place of the experts build_model wrapped, then parallelize()
swaps their dispatcher and parameters in place: the wrappers must survive both. A dropped wrapper
trains the same, so each run also counts the activation outputs the recompute freed (one per MoE
layer and micro-batch) or the bytes the offload moved."""

import pytest
import torch
from conftest import write_text_corpus
from layouts import ALIGNED_QWEN3, config, train
from ranks import run_ranks

from moefold.memory import recompute
from moefold.moe.experts import Fp8GroupedExperts

STEPS = 2
FP8 = {**ALIGNED_QWEN3, "precision.fp8": "rowwise", "precision.fp8_emulate": "true", "train.warmup_steps": "0"}
RECOMPUTED = {"memory.recompute": '["moe_act"]'}
OFFLOADED = {"memory.offload": '["moe_act"]', "memory.offload_min_bytes": "0"}

# (name, dp, parallel sizes) on 2 ranks; tp > 1 is sequence-parallel (the default).
LAYOUTS = [("ep2", 2, dict(ep=2)), ("ep2-allgather", 2, dict(ep=2, ep_dispatcher="allgather")),
           ("tp2-sp", 1, dict(tp=2)), ("tp2-etp2", 1, dict(tp=2, etp=2))]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_text_corpus(tmp_path_factory.mktemp("corpus"))


def _count_discards(setattr_=setattr) -> list[int]:
    """Count the recompute's freed producer outputs in this process (moe_act's h, here)."""
    count = [0]
    discard = recompute._Run.discard_until_backward_of

    def counting(self, consumer_out):
        count[0] += 1
        return discard(self, consumer_out)
    setattr_(recompute._Run, "discard_until_backward_of", counting)
    return count


def _memory_facts(trainer) -> dict:
    offload = getattr(trainer.model, "activation_offload", None)
    return {"fp8_experts": [isinstance(layer.experts, Fp8GroupedExperts) for layer in trainer.model.moe_layers()],
            "moe_layers": len(trainer.model.moe_layers()),
            "offloaded_bytes": offload.offloaded_bytes if offload is not None else 0}


def _runs_on_rank(rank: int, runs: list[tuple], out) -> None:
    """Each run: (name, model, data_path, dp, parallel, run_dir, extra); rank 0 saves the results."""
    discards = _count_discards()
    results = {}
    for name, model, data_path, dp, parallel, run_dir, extra in runs:
        before = discards[0]
        result = train(config(model, data_path, dp, STEPS, extra, **parallel), run_dir, finish=_memory_facts)
        results[name] = {**result, "discards": discards[0] - before}
    if rank == 0:
        torch.save(results, out)


def _assert_same_training(run: dict, ref: dict, note: str) -> None:
    """Bit for bit: the same layout and data, the recompute rebuilds h exactly."""
    assert run["losses"] == ref["losses"], f"{note}: losses {run['losses']} != {ref['losses']}"
    assert run["grad_norms"] == ref["grad_norms"], f"{note}: grad norms"
    differ = [n for n, g in ref["grads"].items() if not torch.equal(run["grads"][n], g)]
    assert not differ, f"{note}: first-step gradients of {differ} differ"


def test_fp8_with_moe_act_recomputed_trains_like_fp8_under_each_layout(corpus, tmp_path):
    """ep 2 (all-to-all and all-gather), tp 2 sequence-parallel, tp 2 with etp 2: the recomputed
    run's losses, gradient norms and first-step gradients equal the plain FP8 run's on the same
    layout, and h was freed in every MoE layer of every micro-batch (the pair survived apply_fp8
    and parallelize)."""
    runs = [(f"{name}-{kind}", "qwen3", corpus, dp, parallel, tmp_path / f"{name}-{kind}",
             {**FP8, **memory})
            for name, dp, parallel in LAYOUTS for kind, memory in (("plain", {}), ("recomputed", RECOMPUTED))]
    out = tmp_path / "results.pt"
    run_ranks(2, _runs_on_rank, runs, out)
    results = torch.load(out)
    for name, _, _ in LAYOUTS:
        plain, recomputed = results[f"{name}-plain"], results[f"{name}-recomputed"]
        assert all(recomputed["fp8_experts"]) and recomputed["moe_layers"] > 0, name
        _assert_same_training(recomputed, plain, name)
        assert plain["discards"] == 0, name
        freed = recomputed["discards"]
        assert freed == STEPS * recomputed["moe_layers"], f"{name}: h freed {freed} times"


def test_fp8_with_moe_act_offloaded_under_ep_trains_like_fp8_and_offloads(corpus, tmp_path):
    """DeepSeek (dense first layer, shared expert, an MTP block) under ep 2: moe_act offloaded
    trains as plain FP8, bit for bit, and moves bytes to the host."""
    runs = [(kind, "deepseek", corpus, 2, dict(ep=2), tmp_path / kind,
             {"precision.fp8": "rowwise", "precision.fp8_emulate": "true", "train.warmup_steps": "0", **memory})
            for kind, memory in (("plain", {}), ("offloaded", OFFLOADED), ("recomputed", RECOMPUTED))]
    out = tmp_path / "results.pt"
    run_ranks(2, _runs_on_rank, runs, out)
    results = torch.load(out)
    _assert_same_training(results["offloaded"], results["plain"], "deepseek ep2 offloaded")
    _assert_same_training(results["recomputed"], results["plain"], "deepseek ep2 recomputed")
    assert results["offloaded"]["offloaded_bytes"] > 0
    assert results["recomputed"]["discards"] == STEPS * results["recomputed"]["moe_layers"]


def test_one_process_trainer_run_resumes_bit_for_bit_with_fp8_and_moe_act_recomputed(corpus, tmp_path,
                                                                                     monkeypatch):
    """The Trainer in one process, FP8 with moe_act recomputed, two micro-batches a step and the
    weight cache: the same losses as without the recompute; saved at step 2 of 4 and resumed, the
    resumed steps' losses are the uninterrupted run's."""
    extra = {**FP8, "train.grad_accum": "2", "precision.fp8_weight_cache": "true"}
    cfg = config("qwen3", corpus, steps=4, extra={**extra, **RECOMPUTED})
    discards = _count_discards(monkeypatch.setattr)
    full = train(cfg, tmp_path / "full", save_at=2, finish=_memory_facts)
    assert discards[0] == 4 * 2 * full["moe_layers"]
    plain = train(config("qwen3", corpus, steps=4, extra=extra), tmp_path / "plain")
    assert full["losses"] == plain["losses"]
    resumed = train(cfg, tmp_path / "resumed", resume=tmp_path / "full")
    assert resumed["losses"] == full["losses"][2:]


# The memory planner against the wrapped FP8 model parallelized as the trainer does it, measured
# on each rank (plan.measure, a DTensor by its local shard), fp32 and round-robin routing (the
# balanced share the plan assumes).
PLAN_BASE = {"model.dim": 128, "moe.expert_hidden": 128, "model.ffn_hidden": 128, "train.micro_batch_size": 2,
             "precision.compute_dtype": "fp32", "optim.master_dtype": "fp32", "moe.force_balanced": True,
             "precision.fp8": "rowwise"}
KEPT = {"precision.fp8_saved_activations": True}
PLAN_CASES = {
    "ep2": {"parallel.ep": 2, **RECOMPUTED},
    "ep2-kept": {"parallel.ep": 2, **KEPT, **RECOMPUTED},
    "ep2-allgather-kept": {"parallel.ep": 2, "parallel.ep_dispatcher": "allgather", **KEPT, **RECOMPUTED},
    "ep2-offloaded-kept": {"parallel.ep": 2, **KEPT, "memory.offload": '["moe_act"]'},
    "tp2-sp-kept": {"parallel.tp": 2, **KEPT, **RECOMPUTED},
    "tp2-etp2-kept": {"parallel.tp": 2, "parallel.etp": 2, **KEPT, **RECOMPUTED},
}


def _plan_config(name: str):
    from moefold.config import load_config

    memory = {"memory.offload_min_bytes": 4096} if "memory.offload" in PLAN_CASES[name] else {}
    return load_config("tiny-qwen3", {**PLAN_BASE, **memory, **PLAN_CASES[name]})


def _measure_on_rank(rank: int, out) -> None:
    from moefold.parallel.dims import ParallelDims, ParallelLayout
    from moefold.plan.measure import measure_saved_activations

    torch.distributed.init_process_group("gloo")  # env://, as run_ranks sets it
    measured = {}
    for name in PLAN_CASES:
        p = _plan_config(name).parallel
        layout = ParallelLayout(ParallelDims(2, tp=p.tp, ep=p.ep, etp=p.etp))
        saved = measure_saved_activations(_plan_config(name), "fp32", layout=layout)
        measured[name] = {"by_category": saved.by_category, "total": saved.total, "host": saved.host}
    torch.save(measured, f"{out}.{rank}")


@pytest.fixture(scope="module")
def measured_plans(tmp_path_factory):
    out = tmp_path_factory.mktemp("plans") / "measured.pt"
    run_ranks(2, _measure_on_rank, out)
    return [torch.load(f"{out}.{rank}") for rank in range(2)]


@pytest.mark.parametrize("name", PLAN_CASES)
def test_the_planner_counts_fp8_with_moe_act_under_each_layout(measured_plans, name):
    from moefold.plan import predict_memory

    plan = predict_memory(_plan_config(name), 2)
    planned = {k: v for k, v in plan.activations.items() if v}
    for rank, measured in enumerate(measured_plans):
        assert planned == {k: v for k, v in measured[name]["by_category"].items() if v}, f"rank {rank}"
        assert measured[name]["total"] == plan.activation_total
        assert measured[name]["host"] == plan.offloaded
