"""Parallel folding on several GPUs: the layout tests of tests/distributed, one process per GPU on
NCCL, in fp32 and in bf16 autocast, against the same model trained on one GPU without a process
group. Every step's loss and gradient norm must match (fp32: 1e-4 relative, as on gloo; bf16: 1e-2
relative over the 10 steps; the norms at the median step); in fp32 the first step's gradients too.

A checkpoint saved on all the GPUs (EP over all of them) resumes on half of them and on one GPU
with the loss continuing as in the uninterrupted one-GPU run.

Layouts needing more GPUs than the machine has are skipped; on CPU machines all are.
"""

import sys
from pathlib import Path

import pytest
import torch
from conftest import write_text_corpus

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
from gpu_runs import DTYPES, assert_same_training  # noqa: E402
from layouts import (ALIGNED_QWEN3, STEPS, assert_fp8_training_close, config, train,  # noqa: E402
                     train_on_rank)
from ranks import run_ranks  # noqa: E402

pytestmark = pytest.mark.gpu

GPUS = torch.cuda.device_count()
MODELS = ("qwen3", "deepseek")
# (test id, world, dp, parallel sizes): dp = world / (tp·cp·pp) sets the per-rank micro-batch.
LAYOUTS = [
    ("ep2-fsdp", 2, 2, dict(ep=2)),
    ("edp2-fsdp", 2, 2, dict()),
    ("tp2-ep2-folded", 2, 1, dict(tp=2, ep=2)),
    ("tp2-etp2", 2, 1, dict(tp=2, etp=2)),
    ("ddp-ep2", 2, 2, dict(ep=2, data_parallel="ddp")),
    ("allgather-ep2", 2, 2, dict(ep=2, ep_dispatcher="allgather")),
    ("tp2-etp2-ep2", 4, 2, dict(tp=2, etp=2, ep=2)),
    ("dp2-ep4-fsdp", 4, 2, dict(tp=2, ep=4)),
    ("allgather-ep4", 4, 4, dict(ep=4, ep_dispatcher="allgather")),
    ("ep8-fsdp", 8, 8, dict(ep=8)),
    ("tp2-ep8-folded", 8, 4, dict(tp=2, ep=8)),
    ("tp2-etp2-ep4", 8, 4, dict(tp=2, etp=2, ep=4)),
]


def gpu_overrides(dtype: str) -> dict[str, str]:
    return {"train.device": "cuda", "precision.compute_dtype": dtype}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_text_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """One GPU, no process group: {(model, dtype): result}."""
    return {(m, d): train(config(m, corpus, extra=gpu_overrides(d)), tmp_path_factory.mktemp(f"ref-{m}-{d}"))
            for m in MODELS for d in DTYPES}


@pytest.mark.parametrize("name, world, dp, parallel", LAYOUTS, ids=[lay[0] for lay in LAYOUTS])
def test_layout_on_nccl_trains_like_one_gpu(name, world, dp, parallel, corpus, reference, tmp_path):
    if GPUS < world:
        pytest.skip(f"needs {world} GPUs, {GPUS} visible")
    runs = [((m, d), m, corpus, dp, parallel, tmp_path / f"{m}-{d}", None, 0, gpu_overrides(d))
            for m in MODELS for d in DTYPES]
    out = tmp_path / "results.pt"
    run_ranks(world, train_on_rank, runs, out)
    results = torch.load(out)
    for m, d in results:
        assert_same_training(results[m, d], reference[m, d], d, f"{name} {m} {d}")


def test_checkpoint_from_all_gpus_resumes_on_half_and_one(corpus, reference, tmp_path):
    if GPUS < 2:
        pytest.skip("needs 2 GPUs")
    n, half = GPUS, STEPS // 2
    saved = {m: tmp_path / f"ep{n}-{m}" for m in MODELS}
    fp32 = gpu_overrides("fp32")
    run_ranks(n, train_on_rank, [(m, m, corpus, n, dict(ep=n), saved[m], None, half, fp32) for m in MODELS],
              tmp_path / "saved.pt")
    resumed = {}
    if n >= 4:  # on n/2 GPUs under torchrun-style ranks (n = 2: half is the one-GPU case below)
        out = tmp_path / "half.pt"
        run_ranks(n // 2, train_on_rank, [(m, m, corpus, n // 2, dict(ep=n // 2), tmp_path / f"half-{m}",
                                          saved[m], 0, fp32) for m in MODELS], out)
        resumed.update({(f"{n // 2} GPUs", m): r for m, r in torch.load(out).items()})
    for m in MODELS:
        one = config(m, corpus, extra=fp32)
        resumed["1 GPU", m] = train(one, tmp_path / f"one-{m}", resume=saved[m])
    for (where, m), result in resumed.items():
        torch.testing.assert_close(torch.tensor(result["losses"]),
                                   torch.tensor(reference[m, "fp32"]["losses"][half:]), rtol=1e-4, atol=0,
                                   msg=lambda msg, where=where, m=m: f"saved on {n} GPUs, resumed on {where} {m}: {msg}")


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_fp8_experts_under_ep2_on_nccl(dispatcher, corpus, tmp_path):
    """FP8 rowwise with the CUDA kernels (cuBLAS linears, CUTLASS grouped experts) under ep=2 on
    NCCL: each rank pads its experts' rows to the kernels' multiple, and training stays within FP8
    noise of the same FP8 run on one GPU (each data rank scales its own tokens; tolerance as on
    gloo, tests/distributed/test_layouts.py)."""
    if GPUS < 2:
        pytest.skip("needs 2 GPUs")
    extra = {**gpu_overrides("bf16"), **ALIGNED_QWEN3, "precision.fp8": "rowwise"}
    ref = train(config("qwen3", corpus, extra=extra), tmp_path / "ref")
    out = tmp_path / "results.pt"
    run_ranks(2, train_on_rank, [("qwen3", "qwen3", corpus, 2, dict(ep=2, ep_dispatcher=dispatcher),
                                  tmp_path / "ep2", None, 0, extra)], out)
    assert_fp8_training_close(torch.load(out)["qwen3"], ref, f"fp8 ep2 {dispatcher} on NCCL")


def test_fp8_linears_under_tp2_on_nccl(corpus, tmp_path):
    """FP8 rowwise with the CUDA kernels under tp=2 (sequence-parallel) on NCCL: each FP8 linear
    computes on its local shard (fp8/linear.py: ColumnShards, RowShards); within FP8 noise of one GPU
    (bounds as on gloo, tests/distributed/test_layouts.py)."""
    if GPUS < 2:
        pytest.skip("needs 2 GPUs")
    extra = {**gpu_overrides("bf16"), **ALIGNED_QWEN3, "precision.fp8": "rowwise"}
    ref = train(config("qwen3", corpus, extra=extra), tmp_path / "ref")
    out = tmp_path / "results.pt"
    run_ranks(2, train_on_rank, [("qwen3", "qwen3", corpus, 1, dict(tp=2), tmp_path / "tp2", None, 0, extra)], out)
    assert_fp8_training_close(torch.load(out)["qwen3"], ref, "fp8 tp2 on NCCL", grad_rtol=0.2, late_rtol=3e-2)
