"""Precision-aware optimizer states with several ranks: tiny Qwen3-MoE and DeepSeek-V3 trained with
low-precision moments and master weights under FSDP2 and DDP layouts match the one-process run with
the same optimizer settings, and a checkpoint saved under ep4 resumes under ep2 and in one process
with every state in its own dtype and sharded like its parameter.

Tolerances. fp8 blocks run along the last dimension of the global tensor and ranks that split it
complete each block's maximum with an all-reduce, so a layout quantises exactly as one process does:
with fp32 master weights the losses agree to the fp32 layouts' 1e-4 (measured: 2.4e-7). With bf16
parameters ("lean") the forward and backward themselves run in bf16, where a layout's different
summation order (FSDP, TP) changes roundings at bf16's precision, and 10 steps amplify them
(DeepSeek-V3's sign-based expert-bias updates and routing most): the bound is 2^-7 ≈ 7.8e-3,
relative (measured after 10 steps: up to 2.8e-3 over init seeds 0-3; 7.6e-3 at one seed with the
schedule and gradient norm of before their fixes). A wrong reduction or scale is off by far more.
"""

import dataclasses

import pytest
import torch
from conftest import write_text_corpus
from layouts import STEPS
from layouts import config as layout_config
from ranks import run_ranks
from torch.distributed.tensor import DTensor, Replicate

from moefold.optim.blocks import (
    FP8,
    dequantize_fp8,
    quantize_fp8,
    quantize_fp8_many,
    row_blocks,
    scale_like,
)
from moefold.train.trainer import Trainer

MODELS = ("qwen3", "deepseek")
VARIANTS = {
    "lean": {"exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "fp8", "master_dtype": "bf16+remainder"},
    "fp8-bf16": {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "bf16", "master_dtype": "fp32"},
}
LOSS_RTOL = {"lean": 2.0 ** -7, "fp8-bf16": 1e-4}

ALL_RUNS = [(m, v) for m in MODELS for v in VARIANTS]
# World-4 layouts skip Qwen3's fp32-master variant to keep the time on a 2-core machine down.
WORLD4_RUNS = [("qwen3", "lean"), ("deepseek", "lean"), ("deepseek", "fp8-bf16")]
LAYOUTS = [
    ("ep2-fsdp", 2, 2, {"ep": 2}, ALL_RUNS),
    ("tp2-ep2", 4, 2, {"tp": 2, "ep": 2}, WORLD4_RUNS),
    ("ddp-ep2", 4, 4, {"ep": 2, "data_parallel": "ddp"}, WORLD4_RUNS),
]


def config(model: str, variant: str, data_path, dp: int = 1, **parallel):
    cfg = layout_config(model, data_path, dp, **parallel)
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, **VARIANTS[variant]))


def state_kinds(trainer: Trainer) -> set[tuple]:
    """(key, dtype, laid out like its parameter) of every optimizer state."""
    kinds = set()
    for p, state in trainer.optimizer.state.items():
        for key, t in state.items():
            like = (not isinstance(t, DTensor) if key == "step" or not isinstance(p, DTensor)
                    else _sharded_like(t, p, scale=key.endswith("_scale")))
            kinds.add((key, t.dtype, like))
    return kinds


def _sharded_like(t, p: DTensor, scale: bool) -> bool:
    """`t` has `p`'s mesh and placements; fp8 scales are replicated where `p` splits its last dim
    into pieces that cut 128-element blocks."""
    last = p.dim() - 1
    splits = [i for i, pl in enumerate(p.placements) if getattr(pl, "dim", None) == last]
    want = [Replicate() if scale and i in splits and not _whole_block_pieces(p, splits) else pl
            for i, pl in enumerate(p.placements)]
    return isinstance(t, DTensor) and t.device_mesh == p.device_mesh and list(t.placements) == want


def _whole_block_pieces(p: DTensor, splits: list[int]) -> bool:
    cols = p.shape[-1]
    piece = -(-cols // p.device_mesh.size(splits[0]))  # torch.chunk's
    return len(splits) == 1 and (piece % 128 == 0 or piece >= cols)


def train(cfg, run_dir, resume=None, save_at: int = 0) -> dict:
    """Each step's loss (mean over the data ranks) and the optimizer's state kinds after loading."""
    trainer = Trainer(cfg, run_dir, resume=resume, out=lambda line: None)
    kinds = state_kinds(trainer)
    losses = []
    while trainer.step < cfg.train.steps:
        parts = trainer.accumulate_gradients()
        trainer.optimizer_step()
        trainer.step += 1
        losses.append(trainer.dist.mean_over_data(parts["lm_loss"].detach()).item())
        if trainer.step == save_at:
            trainer.save()
    return {"losses": losses, "kinds": kinds}


def train_on_rank(rank: int, runs: list[tuple], out) -> None:
    """Each run: (name, model, variant, data_path, dp, parallel, run_dir, resume, save_at)."""
    results = {}
    for name, model, variant, data_path, dp, parallel, run_dir, resume, save_at in runs:
        results[name] = train(config(model, variant, data_path, dp, **parallel), run_dir, resume, save_at)
    if rank == 0:
        torch.save(results, out)


def quantise_shards_on_rank(rank: int) -> None:
    """Each DTensor's shard quantised on its own (and all at once) equals the one-process
    quantisation of the whole tensor, bit for bit: shards along rows, along the last dimension
    with blocks straddling the split, and an empty shard."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    gen = torch.Generator().manual_seed(0)
    cases = [((300,), 0), ((3, 200), 1), ((5, 130), 0), ((64,), 0), ((1, 40), 0), ((2, 3, 260), 2),
             ((3, 512), 1), ((2, 255), 1), ((512,), 0)]  # the last three split at block boundaries
    fulls = [torch.randn(shape, generator=gen) * torch.rand(shape, generator=gen).exp2().pow(6)
             for shape, _ in cases]
    dts = [distribute_tensor(x, mesh, [Shard(dim)]) for x, (_, dim) in zip(fulls, cases)]
    bs = [row_blocks(d) for d in dts]
    qs_many, scales_many = quantize_fp8_many([d.to_local() for d in dts], bs)
    for x, d, b, q_many, scale_many in zip(fulls, dts, bs, qs_many, scales_many, strict=True):
        q_ref, scale_ref = quantize_fp8(x, row_blocks(x))
        q, scale = quantize_fp8(d.to_local(), b)
        template = scale_like(d)
        assert template.shape == scale_ref.view(*x.shape[:-1], -1).shape
        whole_scale = DTensor.from_local(scale.view_as(template.to_local()), mesh, template.placements,
                                         shape=template.shape, stride=template.stride()).full_tensor()
        assert torch.equal(whole_scale.reshape(-1), scale_ref.reshape(-1)), x.shape
        whole_q = DTensor.from_local(q.view(torch.uint8), mesh, d.placements, shape=d.shape,
                                     stride=d.stride()).full_tensor()
        assert torch.equal(whole_q, q_ref.view(torch.uint8)), x.shape
        assert torch.equal(q_many.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale_many, scale)
        assert torch.equal(dequantize_fp8(q, scale, b), dequantize_fp8(q_ref, scale_ref, row_blocks(x))
                           .reshape(x.shape)[tuple(slice(o, o + n) for o, n in
                                                   zip(_offset(d), d.to_local().shape))])


def aligned_splits_on_rank(rank: int, out) -> None:
    """A last dimension split at block boundaries (even, uneven with a short last block, 1-D) is
    quantised piece by piece with no collective, its scales split like it; the optimizer then
    steps exactly as one process does. A split that cuts blocks still all-reduces."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from moefold.optim.precision import PrecisionAwareAdamW

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    gen = torch.Generator().manual_seed(0)
    shapes = [(3, 512), (2, 255), (512,), (3, 200)]  # pieces 256, 128 + 127, 256; 100 (cuts a block)
    fulls = [torch.randn(shape, generator=gen) for shape in shapes]
    grads = [torch.randn(shape, generator=gen) for shape in shapes]
    params = [torch.nn.Parameter(distribute_tensor(x, mesh, [Shard(x.dim() - 1)])) for x in fulls]
    reference = [torch.nn.Parameter(x.clone()) for x in fulls]
    calls = []
    real_all_reduce = dist.all_reduce
    dist.all_reduce = lambda t, *a, **k: calls.append(t.numel()) or real_all_reduce(t, *a, **k)
    try:
        collectives = []
        for d in params:
            calls.clear()
            quantize_fp8(d.to_local(), row_blocks(d))
            collectives.append(len(calls))
    finally:
        dist.all_reduce = real_all_reduce
    options = {"lr": 1e-2, "exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8"}
    for ps, gs in ((params, [distribute_tensor(g, mesh, p.placements) for g, p in zip(grads, params)]),
                   (reference, grads)):
        opt = PrecisionAwareAdamW(ps, **options)
        for _ in range(2):
            for p, g in zip(ps, gs):
                p.grad = g
            opt.step()
        if ps is params:
            sharded_states = [{k: _bytes_whole(v) for k, v in opt.state[p].items() if k != "step"} for p in ps]
            placements = [opt.state[p]["exp_avg_scale"].placements for p in ps]
        else:
            states = [{k: _bytes(v) for k, v in opt.state[p].items() if k != "step"} for p in ps]
    same = [torch.equal(p.full_tensor(), r.detach()) and all(torch.equal(s[k], r_s[k]) for k in r_s)
            for p, r, s, r_s in zip(params, reference, sharded_states, states, strict=True)]
    if rank == 0:
        torch.save({"collectives": collectives, "same": same, "placements": [list(p) for p in placements]}, out)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t  # gloo moves no fp8; compare bit for bit


def _bytes_whole(d: DTensor) -> torch.Tensor:
    return DTensor.from_local(_bytes(d.to_local()), d.device_mesh, d.placements, shape=d.shape,
                              stride=d.stride()).full_tensor()


def test_splits_at_block_boundaries_need_no_collective(tmp_path):
    run_ranks(2, aligned_splits_on_rank, tmp_path / "out.pt")
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    assert out["collectives"] == [0, 0, 0, 1]
    assert out["same"] == [True] * 4
    assert [type(p[0]).__name__ for p in out["placements"]] == ["Shard", "Shard", "Shard", "Replicate"]


def _offset(d: DTensor) -> tuple:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(d.shape, d.device_mesh, d.placements)[1]


def test_sharded_fp8_quantisation_is_the_one_process_quantisation():
    run_ranks(2, quantise_shards_on_rank)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_text_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """One-process runs of every model and optimizer variant."""
    return {(m, v): train(config(m, v, corpus), tmp_path_factory.mktemp(f"ref-{m}-{v}"))
            for m in MODELS for v in VARIANTS}


def _check_losses(losses, ref_losses, variant: str, note: str) -> None:
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=LOSS_RTOL[variant],
                               atol=0, msg=lambda m: f"{note}: {m}")


@pytest.mark.parametrize("name, world, dp, parallel, runs", LAYOUTS, ids=[lay[0] for lay in LAYOUTS])
def test_layout_matches_one_process(name, world, dp, parallel, runs, corpus, reference, tmp_path):
    run_ranks(world, train_on_rank, [(f"{m}-{v}", m, v, corpus, dp, parallel, tmp_path / f"{m}-{v}",
                                      None, 0) for m, v in runs], tmp_path / "results.pt")
    results = torch.load(tmp_path / "results.pt")
    for m, v in runs:
        result, ref = results[f"{m}-{v}"], reference[m, v]
        assert len(result["losses"]) == STEPS
        _check_losses(result["losses"], ref["losses"], v, f"{name} {m} {v}")
        assert result["kinds"] == ref["kinds"], f"{name} {m} {v}"


LEAN_KINDS = {("step", torch.float32, True), ("exp_avg", torch.bfloat16, True),
              ("exp_avg_sq", FP8, True), ("exp_avg_sq_scale", torch.float32, True),
              ("master_remainder", torch.int16, True)}


def test_lean_states_resume_under_other_layouts(corpus, reference, tmp_path):
    """DeepSeek-V3 (MLA, shared expert, MTP: every kind of parameter) saved at step 5 under ep4
    (world 4: the norms' fp8 blocks split over four FSDP ranks); resumed under ep2 (world 2) and in
    one process, the loss continues the uninterrupted run's and every state keeps its dtype and its
    parameter's layout."""
    half, m, v = STEPS // 2, "deepseek", "lean"
    saved = tmp_path / "ep4"
    run_ranks(4, train_on_rank, [(m, m, v, corpus, 4, {"ep": 4}, saved, None, half)], tmp_path / "saved.pt")
    run_ranks(2, train_on_rank, [(m, m, v, corpus, 2, {"ep": 2}, tmp_path / "ep2", saved, 0)],
              tmp_path / "ep2.pt")
    one = train(config(m, v, corpus), tmp_path / "one", resume=saved)
    for where, result in (("ep2", torch.load(tmp_path / "ep2.pt")[m]), ("one process", one)):
        _check_losses(result["losses"], reference[m, v]["losses"][half:], v, f"resumed {where}")
        assert result["kinds"] == LEAN_KINDS, f"resumed {where}"
