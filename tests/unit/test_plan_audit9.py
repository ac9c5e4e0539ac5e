"""Audit 9 of the memory planner (plan/*): each check against an independent reference, not the
planner's own formulas: a real training micro-batch under FakeTensorMode with every storage followed
from allocation to release (plan.peaks)."""

import pytest

from moefold.config import load_config, preset_names
from moefold.plan import predict_memory
from moefold.plan.peaks import measure_peaks

# Two Qwen3-30B-A3B layers with a small vocabulary, so that a layer, not the loss, sets the peaks.
QWEN3_LAYERS = {"model.n_layers": 2, "train.micro_batch_size": 2, "train.seq_len": 2048,
                "model.vocab_size": 4096}


# A recomputed (or offloaded) block keeps little for backward, but while its forward runs it makes
# every tensor the plain block would keep: under fp32 parameters the experts' bf16 weight casts and
# their [R, F] rows, freed only as the block returns. The plan's forward ended with the kept bytes
# and the loss's workspace, and put the forward peak 5.4% (recompute ["layer"], 845 MiB) and 4.3%
# (["moe"]) below the tracked run's.
@pytest.mark.parametrize("names", ['["layer"]', '["moe"]'])
def test_forward_peak_holds_a_recomputed_block_s_own_tensors_while_it_runs(names):
    cfg = load_config("qwen3-30b-a3b", {**QWEN3_LAYERS, "memory.recompute": names})
    measured, plan = measure_peaks(cfg, "fp32"), predict_memory(cfg, 1)
    assert plan.phase_peak("forward") == pytest.approx(measured.forward, rel=0.05)
    assert plan.phase_peak("forward") >= measured.forward
    # The table's transient row (the largest working set) left that layer's out: 428 MiB where the
    # forward phase held 1,856 MiB (["layer"]).
    assert plan.transient >= max(parts.get("transient", 0) for parts in plan.phases.values())


# ------------------------------------- the all-to-all buffers against the exchanged tensors

ALL_TO_ALL = {  # world size, overrides
    "ep 2, dropless": (2, {"parallel.ep": "2"}),
    # every rank sends each expert exactly C = 2·T·K/E rows: twice its T·K copies
    "ep 2, padded to capacity 2": (2, {"parallel.ep": "2", "moe.capacity_factor": "2.0", "moe.pad_to_capacity": "true"}),
    "ep 2, padded to capacity 0.5": (2, {"parallel.ep": "2", "moe.capacity_factor": "0.5", "moe.pad_to_capacity": "true"}),
    # each EP index's rows go to both of its ETP ranks: twice the copies each way
    # under sequence parallelism each TP rank drops and pads its own T/tp tokens' copies
    "tp 2 · ep 2, padded to capacity 1.5": (4, {"parallel.tp": "2", "parallel.ep": "2", "moe.capacity_factor": "1.5",
                                                "moe.pad_to_capacity": "true", "parallel.data_parallel": "ddp"}),
    "ep 2 · etp 2, dropless": (4, {"parallel.ep": "2", "parallel.etp": "2", "parallel.data_parallel": "ddp"}),
}


def _exchanged_on_rank(rank: int, run_dir: str) -> dict:
    """Per case: (planned, this rank's) bytes of the input and output of the step's first
    all-to-all, the first MoE layer's dispatch of its tokens' rows."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from moefold.train.trainer import Trainer

    out, exchange = {}, funcol.all_to_all_single_autograd
    for i, (name, (world, overrides)) in enumerate(ALL_TO_ALL.items()):
        if world != dist.get_world_size():
            continue
        sizes = []

        def recorded(x, *args, **kwargs):
            y = exchange(x, *args, **kwargs)
            sizes.append((x.numel() + y.numel()) * x.element_size())
            return y

        funcol.all_to_all_single_autograd = recorded
        try:
            cfg = load_config("tiny-qwen3", {**overrides, "train.micro_batch_size": "2", "train.seq_len": "16",
                                                "precision.compute_dtype": "fp32"})
            trainer = Trainer(cfg, f"{run_dir}/{i}-{rank}", out=lambda line: None)
            trainer.accumulate_gradients()
        finally:
            funcol.all_to_all_single_autograd = exchange
        plan = predict_memory(cfg, world, vocab_size=trainer.vocab_size)
        out[name] = (plan.comm_buffers["all-to-all (one MoE layer)"], sizes[0])
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_buffers_are_the_exchanged_rows(tmp_path, world):
    """The plan's send and receive buffers of one MoE layer against the rows the dispatcher
    exchanged (fp32 compute, as the CPU runs). Dropless routing leaves a rank what the
    router sends it, so there the plan is the ranks' mean. The plan counted T/tp·K rows each way
    whatever the layout: capacity padding's E·C rows (2x and 0.5x here) and ETP's copy of each
    row for every ETP rank (2x) were not in it."""
    from test_parallel_dims import results_on_ranks

    ranks = results_on_ranks(_exchanged_on_rank, world, tmp_path, str(tmp_path))
    for name in ranks[0]:
        planned, real = ranks[0][name][0], [r[name][1] for r in ranks]
        if "dropless" in name:
            assert planned == sum(real) / world, (name, planned, real)
        else:
            assert [planned] * world == real, (name, planned, real)


# ------------------------ parameters and states against what a rank holds after parallelize

@pytest.mark.parametrize("preset", preset_names())
def test_each_rank_s_parameters_are_what_parallelize_leaves_it(preset):
    """Every preset on the meta device, played as the last rank of 4 (torch's fake process group,
    as benchmarks/sharded_init.py plays one) under tp 2 · ep 2 · etp 2 and ddp, which shards no
    parameter: the plan's parameter bytes are the numel of the rank's local tensors, fp32 each."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from moefold.data.tokenizer import model_vocab_size
    from moefold.models.transformer import build_model
    from moefold.parallel.apply import parallelize
    from moefold.parallel.dims import ParallelDims, ParallelLayout
    from moefold.parallel.local import local_tensor

    layout = {"parallel.tp": "2", "parallel.ep": "2", "parallel.etp": "2", "parallel.data_parallel": "ddp"}
    if preset in ("tiny", "tiny-mixtral", "tiny-qwen3"):
        layout["model.n_kv_heads"] = "2"  # tp 2 holds whole key/value heads
    cfg = load_config(preset, layout)
    vocab = model_vocab_size(cfg)
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    try:
        with torch.device("meta"):
            model = build_model(cfg, vocab)
        p = cfg.parallel
        parallelize(model, ParallelLayout(ParallelDims(4, p.tp, p.cp, p.pp, p.ep, p.etp, p.order)), p)
        held = sum(local_tensor(t).numel() for t in {id(t): t for t in model.parameters()}.values())
    finally:
        dist.destroy_process_group()
    assert predict_memory(cfg, 4, vocab_size=vocab).parameters == 4 * held


STATES = {  # layouts and state dtypes test_plan_bench_audit's 2 ranks leave out, on 4
    "MLA, MTP, shared expert; fsdp, tp 2, ep 2": ("tiny-deepseek", {"parallel.tp": "2", "parallel.ep": "2"}),
    "ddp, ep 4, fp8 moments": ("tiny-deepseek", {"parallel.ep": "4", "parallel.data_parallel": "ddp",
                                                 "optim.exp_avg_dtype": "fp8", "optim.exp_avg_sq_dtype": "fp8"}),
    "ddp, tp 2, bf16+remainder, fp8 first moment": (
        "tiny-deepseek", {"parallel.tp": "2", "parallel.data_parallel": "ddp",
                          "optim.master_dtype": "bf16+remainder", "optim.exp_avg_dtype": "fp8"}),
    "fsdp, tp 2, ep 2, fp8 moments": ("tiny-qwen3", {"parallel.tp": "2", "parallel.ep": "2",
                                                     "optim.exp_avg_dtype": "fp8", "optim.exp_avg_sq_dtype": "fp8"}),
    "ddp, ep 2, etp 2, bf16 master": ("tiny-qwen3", {"parallel.ep": "2", "parallel.etp": "2",
                                                      "parallel.data_parallel": "ddp", "optim.master_dtype": "bf16"}),
    "fsdp, ep 2, bf16+remainder, bf16 / fp8 moments": (
        "tiny-mixtral", {"parallel.ep": "2", "optim.master_dtype": "bf16+remainder",
                         "optim.exp_avg_dtype": "bf16", "optim.exp_avg_sq_dtype": "fp8"}),
}


def _states_on_rank(rank: int, run_dir: str) -> dict:
    from test_plan_bench_audit import planned_and_held_states

    out = {}
    for i, (name, (preset, overrides)) in enumerate(STATES.items()):
        cfg = load_config(preset, {**overrides, "train.micro_batch_size": "1", "train.seq_len": "16"})
        out[name] = planned_and_held_states(cfg, f"{run_dir}/{i}-{rank}", 4)
    return out


def test_state_bytes_equal_each_of_4_ranks_real_tensors(tmp_path):
    """4 gloo ranks, a step each: parameters, gradients before the data-parallel reduction,
    remainders and moments (fp8's per-block scales included) against each rank's local tensors;
    under fsdp rank 0's, the busiest (FSDP cuts the 257-row vocabulary unevenly)."""
    from test_parallel_dims import results_on_ranks

    ranks = results_on_ranks(_states_on_rank, 4, tmp_path, str(tmp_path))
    for name in STATES:
        for part in ("parameters", "gradients", "master_weights", "optimizer_moments"):
            planned, real = ranks[0][name][part][0], [r[name][part][1] for r in ranks]
            if "fsdp" in name:
                assert planned == real[0] == max(real), (name, part, planned, real)
            else:
                assert [planned] * 4 == real, (name, part, planned, real)
