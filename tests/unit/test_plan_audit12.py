"""The memory plan of a model groups its identical layers (plan.layers) instead of walking them one
by one: its cost no longer grows with model.n_layers (0.4 ms a layer before, 5 ms with
memory.recompute: `moefold plan memory --model.n_layers 100000000` took hours).

References: the plans printed by the per-layer walk before the change, recorded for the configs
below in plan_audit12_golden.json (every field of the plan and every line of the report), and the
planner with every layer its own group (the per-layer walk, `_per_layer`) on configs whose layers
fall into many runs."""

import dataclasses
import json
import math
import time
from pathlib import Path

import pytest

from moefold.config import load_config
from moefold.plan.memory import predict_memory
from moefold.plan.report import format_plan

GOLDEN = Path(__file__).with_name("plan_audit12_golden.json")

FP8 = {"precision.fp8": "tensorwise", "precision.compute_dtype": "bf16"}
# (preset, overrides, GPUs): presets, uneven pipeline stages, first_k_dense / moe_every /
# dense_layers, MTP blocks, FP8 bf16 first/last layers and fp8_exclude, recompute and offload.
CASES = {
    "deepseek-v3": ("deepseek-v3", {}, 1),
    "deepseek-v3 pp4 vpp2 uneven": ("deepseek-v3", {"parallel.pp": "4", "parallel.vpp": "2",
                                                    "parallel.ep": "8", "train.global_batch_size": "64"}, 64),
    "deepseek-v3 pp3 ddp fp8 moments": ("deepseek-v3", {"parallel.pp": "3", "parallel.data_parallel": "ddp",
                                                        "optim.exp_avg_dtype": "fp8", "parallel.tp": "2"}, 12),
    "qwen3-235b pp5 uneven recompute": ("qwen3-235b-a22b", {"parallel.pp": "5", "parallel.ep": "4",
                                                            "memory.recompute": '["moe_act", "norm"]'}, 40),
    "qwen3-30b offload": ("qwen3-30b-a3b", {"memory.offload": '["attn_core"]', "parallel.ep": "2"}, 4),
    "qwen3-moe-300m sp tp2": ("qwen3-moe-300m", {"parallel.tp": "2"}, 4),
    "mixtral-8x7b": ("mixtral-8x7b", {}, 8),
    "mixtral-8x7b pp2 recompute layer": ("mixtral-8x7b", {"parallel.pp": "2", "memory.recompute": '["layer"]'}, 4),
    "tiny-deepseek dense pattern mtp pp2": ("tiny-deepseek", {
        "model.n_layers": "11", "model.mtp_layers": "2", "moe.first_k_dense": "2", "moe.moe_every": "3",
        "moe.dense_layers": "[8]", "parallel.pp": "2"}, 4),
    "tiny-deepseek mtp recompute offload": ("tiny-deepseek", {
        "model.n_layers": "9", "model.mtp_layers": "2", "moe.moe_every": "2",
        "memory.recompute": '["attn_core"]', "memory.offload": '["moe"]'}, 2),
    "tiny fp8 bf16 first/last, exclude": ("tiny", {
        **FP8, "model.n_layers": "9", "precision.fp8_bf16_first_layers": "2",
        "precision.fp8_bf16_last_layers": "1", "precision.fp8_exclude": '["layers.4.*", "*.attn.wq"]',
        "parallel.pp": "2"}, 2),
    "tiny fp8 weight cache ddp, digit-dependent exclude": ("tiny", {
        **FP8, "model.n_layers": "13", "precision.fp8_weight_cache": "true", "parallel.data_parallel": "ddp",
        "precision.fp8_exclude": '["layers.1*.ffn.experts"]', "precision.fp8_saved_activations": "true"}, 2),
    "tiny fp8 mtp pp3": ("tiny-deepseek", {
        **FP8, "model.n_layers": "10", "model.mtp_layers": "1", "parallel.pp": "3",
        "precision.fp8_bf16_last_layers": "2"}, 3),
}


def _plan(case: str):
    preset, overrides, gpus = CASES[case]
    cfg = load_config(preset, overrides)
    return cfg, predict_memory(cfg, gpus)


def _summary(cfg, plan) -> dict:
    """Every field of the plan but its layer ids (which the report lists), its peak and its report."""
    fields = {k: v for k, v in dataclasses.asdict(plan).items() if k != "layers"}
    fields["in_flight"] = list(fields["in_flight"])
    return {**fields, "peak": plan.peak, "report": format_plan(plan, cfg, 141, "h200").splitlines()}


def _same(got, want, path="plan") -> None:
    """Equal, floats to 1 part in 10^12 (grouping multiplies where the walk added)."""
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), path
        for key in want:
            _same(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{path}[{i}]")
    elif isinstance(want, float) or isinstance(got, float):
        assert math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-6), (path, got, want)
    else:
        assert got == want, (path, got, want)


@pytest.mark.parametrize("case", list(CASES))
def test_plan_equals_the_per_layer_walk_recorded(case):
    want = json.loads(GOLDEN.read_text())[case]
    _same(json.loads(json.dumps(_summary(*_plan(case)))), want)


def _timed_plan(n_layers: int, overrides: dict) -> float:
    """The fastest of three plans of DeepSeek-V3 with `n_layers` layers (seconds)."""
    cfg = load_config("deepseek-v3", {**overrides, "model.n_layers": str(n_layers)})
    times = []
    for _ in range(3):
        start = time.perf_counter()
        predict_memory(cfg, 256)
        times.append(time.perf_counter() - start)
    return min(times)


@pytest.mark.parametrize("overrides", [
    {"parallel.pp": "8", "parallel.ep": "8"},
    {"parallel.pp": "4", "parallel.vpp": "2", "memory.recompute": '["moe_act", "norm"]', "moe.moe_every": "3",
     "moe.dense_layers": "[5]", "model.mtp_layers": "2"},
    {"parallel.pp": "2", "memory.offload": '["attn_core"]', "moe.first_k_dense": "5"},
], ids=["pp8", "vpp recompute moe_every mtp", "offload"])
def test_plan_of_10_to_the_8_layers_costs_what_8_layers_cost(overrides):
    """Before: 0.4 ms a layer (5 ms with memory.recompute), about 11 hours for 10^8 layers."""
    small = _timed_plan(8, overrides)
    assert _timed_plan(10 ** 8, overrides) < 5 * small + 0.2, small


# Configs whose layers fall into many runs: the plan equals the per-layer walk's on every rank.
MANY_RUNS = {
    "moe_every 3, dense_layers, mtp, vpp, recompute": ("tiny-deepseek", {
        "model.n_layers": "37", "model.mtp_layers": "2", "moe.first_k_dense": "4", "moe.moe_every": "3",
        "moe.dense_layers": "[10, 11, 30]", "parallel.pp": "3", "parallel.vpp": "2",
        "memory.recompute": '["moe_act"]'}, 3),
    "moe_every 4, ddp, offload": ("tiny-deepseek", {
        "model.n_layers": "29", "moe.first_k_dense": "1", "moe.moe_every": "4", "parallel.data_parallel": "ddp",
        "memory.offload": '["moe"]', "parallel.pp": "2"}, 4),
    "fp8 first/last, pinned and digit-dependent excludes": ("tiny", {
        **FP8, "model.n_layers": "23", "moe.moe_every": "2", "precision.fp8_bf16_first_layers": "3",
        "precision.fp8_bf16_last_layers": "4", "precision.fp8_exclude": '["layers.7.ffn*", "layers.1?.attn.*"]',
        "parallel.pp": "2", "train.global_batch_size": "64"}, 2),
    "fp8 weight cache, moe_every 2, mtp": ("tiny-deepseek", {
        **FP8, "model.n_layers": "31", "model.mtp_layers": "3", "moe.moe_every": "2",
        "precision.fp8_weight_cache": "true", "parallel.data_parallel": "ddp",
        "precision.fp8_bf16_last_layers": "5", "memory.recompute": '["attn_core"]'}, 2),
}


def _per_layer(cfg, layers: range) -> list:
    """Every layer its own run, in order: the walk the planner made before."""
    from moefold.plan.layers import Run
    return [Run(i, 1) for i in layers]


@pytest.mark.parametrize("case", list(MANY_RUNS))
def test_plan_equals_the_per_layer_walk(monkeypatch, case):
    import moefold.plan.memory as memory

    preset, overrides, gpus = MANY_RUNS[case]
    cfg = load_config(preset, overrides)
    grouped = _summary(cfg, predict_memory(cfg, gpus))
    monkeypatch.setattr(memory, "layer_runs", _per_layer)
    walked = _summary(cfg, predict_memory(cfg, gpus))
    _same(grouped, json.loads(json.dumps(walked)))


@pytest.mark.parametrize("case", list(MANY_RUNS))
def test_runs_group_layers_the_planner_sees_alike(case):
    """Each layer's planner-facing costs (saved bytes, recompute/offload change, parameters) summed
    layer by layer equal each run's first layer's times its count, chunk by chunk."""
    from moefold.plan import activations as act, options
    from moefold.plan.layers import layer_runs
    from moefold.plan.memory import _layout, _shapes
    from moefold.plan.params import layer_params
    from moefold.plan.pipeline import model_chunks

    preset, overrides, gpus = MANY_RUNS[case]
    cfg = load_config(preset, overrides)
    lay = _layout(cfg, gpus)
    sh = _shapes(cfg, lay, 1.0)

    def costs(i):
        return (tuple(sorted(act.layer_bytes(cfg, i, sh).items())),
                tuple(sorted(options.layer_delta(cfg, i, sh)[0].items())), options.layer_delta(cfg, i, sh)[1],
                layer_params(cfg, i), act.cached_fp8_experts(cfg, i, sh))

    from collections import Counter
    for chunk in model_chunks(cfg.model.n_layers, cfg.model.mtp_layers, lay.dims.pp, cfg.parallel.vpp):
        runs = layer_runs(cfg, chunk.layers)
        assert sum(r.count for r in runs) == len(chunk.layers)
        grouped = Counter()
        for r in runs:
            grouped[costs(r.layer)] += r.count
        assert grouped == Counter(costs(i) for i in chunk.layers), chunk


def record() -> None:
    """Writes plan_audit12_golden.json from today's planner (run once, before the change)."""
    GOLDEN.write_text(json.dumps({case: _summary(*_plan(case)) for case in CASES}, indent=1) + "\n")


if __name__ == "__main__":
    record()


# ------------------------------------------- FSDP2: a block's sharded and unsharded gradients

# fp32 masters: the backward peak is the last block's step, the gradients' most (with a bf16
# master it comes a block earlier, where more activations are held). Not tied embeddings: the
# head's part of the tied weight's gradient waits in autograd's input buffer (no .grad that
# FsdpGradients sees) until the embedding's backward adds its own.
GRADIENT_CASES = {"fp32 gradients": {}, "bf16 gradients": {"optim.grad_dtype": "bf16"}}


def _gradients_on_rank(rank: int, run_dir: str) -> dict:
    """Per case: the most bytes of FSDP2's gradients alive at once in one micro-batch's backward
    (unsharded, send buffers and the sharded ones made so far), the plan's gradients and
    reduce-scatter bytes at its backward peak, and the elements of a block's non-expert group."""
    import torch.distributed as dist
    from test_plan_fsdp_buffers_audit9 import FsdpGradients, accumulate_recording, tiny_trainer

    from moefold.parallel.data import expert_parameters
    from moefold.plan.memory import BACKWARD_ONLY

    out = {}
    for i, (name, overrides) in enumerate(GRADIENT_CASES.items()):
        cfg, trainer = tiny_trainer(overrides, f"{run_dir}/{i}-{rank}")
        gradients = FsdpGradients(trainer.model)
        accumulate_recording(trainer, gradients, after_post_backward=True)
        plan = predict_memory(cfg, dist.get_world_size(), vocab_size=trainer.vocab_size)
        backward = plan.phases["backward"]
        other_comm = sum(v for k, v in plan.comm_buffers.items() if k != BACKWARD_ONLY)
        planned = backward["gradients"] + backward["communication"] - other_comm
        experts = {id(p) for p in expert_parameters(trainer.model)}
        block = next(iter(trainer.model.blocks()))
        dense = sum(p.numel() for p in block.parameters() if id(p) not in experts)
        out[name] = (gradients.total, planned, dense)
    return out


def test_backward_counts_a_blocks_gradients_sharded_or_unsharded_not_both(tmp_path):
    """Without gradient accumulation the backward peak counted the block being reduce-scattered
    twice: its unsharded gradients and send buffer (the reduce-scatter row) and its sharded
    gradients, which FSDP2 makes only as that reduce-scatter ends (measured on 2 gloo ranks,
    tiny-qwen3 fp32: 583,488 B of gradients at most, planned 811,392, 227,904 over where the stated
    margin is 103,680: a block's 124,224 B of sharded gradients beyond it; 687,168 now). Now the plan bounds
    the real most within the reduce-scatter row's margin: (master + reduce) bytes per element of
    the block's non-expert group, which FSDP2 reduces apart from its experts."""
    from test_parallel_dims import results_on_ranks

    ranks = results_on_ranks(_gradients_on_rank, 2, tmp_path, str(tmp_path))
    for name, overrides in GRADIENT_CASES.items():
        master = 2 if "optim.master_dtype" in overrides else 4
        reduce = 2 if overrides.get("optim.grad_dtype") == "bf16" else master
        real = max(r[name][0] for r in ranks)
        planned, dense = ranks[0][name][1], ranks[0][name][2]
        assert 0 <= planned - real <= (master + reduce) * dense, (name, planned, real, dense)
