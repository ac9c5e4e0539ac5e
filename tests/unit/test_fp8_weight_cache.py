"""precision.fp8_weight_cache (fp8/weight_cache.py): the experts' FP8 weights quantized once per
optimizer step give the results of quantizing them in every GEMM, bit for bit — in one grouped
GEMM, under torch.compile, and over whole training runs with several micro-batches a step, where
a cache left stale by an optimizer step would diverge from the second step on."""

import types

import pytest
import torch

from moefold.config import load_config
from moefold.errors import ConfigError
from moefold.fp8.grouped import (
    EmulatedFp8GroupedGemm,
    HighPrecisionGroupedWeightGrad,
    fp8_grouped_mms,
    grouped_scaling,
)
from moefold.fp8.weight_cache import CachedWeights, refresh_weight_caches
from moefold.moe.experts import Fp8GroupedExperts
from moefold.plan.refuse import refuse_weight_cache_over_fsdp
from moefold.train.trainer import Trainer

SIZES = {"rowwise": [32, 0, 48, 16], "blockwise": [128, 0, 256, 128]}


def _rand(shape, seed, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def _saved(fn):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return out, saved


@pytest.mark.parametrize("weight_grad", ["fp8", "bf16"])
@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_cached_operands_give_the_per_call_gemms_bit_for_bit(recipe, weight_grad):
    """Gate and up with their forward and grad_input operands given: the outputs and gradients of
    quantizing in the GEMMs, and the backward keeps the cached FP8 operands, not the weights."""
    scaling, sizes = grouped_scaling(recipe), SIZES[recipe]
    gemm = EmulatedFp8GroupedGemm()
    gemm = HighPrecisionGroupedWeightGrad(gemm) if weight_grad == "bf16" else gemm
    E, K, N, used = len(sizes), 128, 256, sum(sizes)
    offsets_E = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x = _rand((used + 16, K), 1)
    ws = [_rand((E, K, N), seed, 0.05) for seed in (2, 3)]
    gys = [torch.cat([_rand((used, N), seed), torch.zeros(16, N)]) for seed in (4, 5)]
    cached = ([gemm.weight_operands(w, scaling.forward.b) for w in ws],
              [gemm.weight_operands(w.transpose(-2, -1), scaling.grad_input.b) for w in ws])

    def run(cached):
        xr, *wr = (t.clone().requires_grad_() for t in (x, *ws))
        ys, saved = _saved(lambda: fp8_grouped_mms(xr, wr, offsets_E, gemm, scaling, cached=cached))
        torch.autograd.backward(ys, gys)
        return [y.detach()[:used] for y in ys] + [xr.grad[:used], *(w.grad for w in wr)], saved

    (per_call, kept_per_call), (from_cache, kept_cached) = run(None), run(cached)
    for a, b in zip(per_call, from_cache):
        assert torch.equal(a, b)
    weight_shapes = {(E, K, N)}
    assert sum(t.shape in weight_shapes and t.dtype == x.dtype for t in kept_per_call) == 2
    assert not any(t.shape in weight_shapes and t.dtype == x.dtype for t in kept_cached)
    assert sum(any(t is c for c in kept_cached) for t in cached[1][0] + cached[1][1]) == 2 * len(cached[1][0])


def _experts(cache: bool):
    torch.manual_seed(0)
    scaling = grouped_scaling("rowwise")
    experts = Fp8GroupedExperts(4, 64, 32, None, EmulatedFp8GroupedGemm(), scaling,
                                weight_cache=CachedWeights(torch.bfloat16) if cache else None)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape) * 0.05)
    return experts.bfloat16()


def test_compiled_experts_read_the_refreshed_cache_without_recompiling():
    """A compiled block takes the cached operands as inputs: after the weights change and the
    cache is refreshed (its buffers replaced), the compiled experts give the per-call experts'
    new results without recompiling."""
    cached, per_call = _experts(True), _experts(False)
    rows_E = torch.tensor([32, 0, 48, 16])
    x = _rand((96, 64), 6).bfloat16()
    refresh_weight_caches(cached)
    compiled = torch.compile(cached, backend="aot_eager", fullgraph=True)

    def loss(module):
        return module(x, rows_E).float().square().sum()

    for step in range(3):
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            got = loss(compiled)
        got.backward()
        want = loss(per_call)
        want.backward()
        assert torch.equal(got, want)
        for a, b in zip(cached.parameters(), per_call.parameters()):
            assert torch.equal(a.grad, b.grad)
        with torch.no_grad():  # an optimizer step on both, then the cache follows
            for m in (cached, per_call):
                for p in m.parameters():
                    p.sub_(0.5 * p.grad)
                    p.grad = None
        refresh_weight_caches(cached)


def test_an_unrefreshed_cache_says_what_to_call():
    with pytest.raises(RuntimeError, match="refresh_weight_caches"):
        _experts(True)(_rand((96, 64), 6).bfloat16(), torch.tensor([32, 0, 48, 16]))


def _run(tiny_args_cfg, tmp_path, cache: bool, steps: int = 3):
    cfg = load_config("tiny-qwen3", {**tiny_args_cfg, "precision.fp8_weight_cache": str(cache).lower()})
    trainer = Trainer(cfg, tmp_path / f"run-{cache}", out=lambda line: None)
    losses = []
    for _ in range(steps):
        parts = trainer.accumulate_gradients()
        trainer.optimizer_step()
        losses.append(parts["lm_loss"].item())
    return losses, trainer.validate(), {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("master_dtype", ["fp32", "bf16", "bf16+remainder"])
def test_training_with_the_cache_equals_training_without(master_dtype, text_corpus, tmp_path):
    """Three steps of two micro-batches each, FP8 rowwise (emulated): losses, validation loss and
    final weights equal, bit for bit, with and without the cache — refreshed after every step
    (a stale one would change step 2's loss) and before validation. In fp32 compute (the CPU's;
    no autocast) bf16 masters run the experts in bf16, and the cache quantizes bf16 weights too."""
    overrides = {"data.path": str(text_corpus), "model.dim": "64", "model.n_layers": "2", "model.n_heads": "2",
                 "model.n_kv_heads": "1", "model.head_dim": "32", "moe.num_experts": "4", "moe.top_k": "2",
                 "moe.expert_hidden": "32", "train.seq_len": "32", "train.micro_batch_size": "2",
                 "train.grad_accum": "2", "train.warmup_steps": "1", "train.val_every": "0",
                 "train.val_batches": "1", "train.device": "cpu", "precision.fp8": "rowwise",
                 "logging.tensorboard": "false", "logging.progress_bar": "false",
                 "logging.expert_load_heatmap": "false", "checkpoint.save_at_end": "false",
                 "optim.master_dtype": master_dtype}
    (losses, val, weights), (ref_losses, ref_val, ref_weights) = (
        _run(overrides, tmp_path, True), _run(overrides, tmp_path, False))
    assert losses == ref_losses and val == ref_val
    assert losses[0] != losses[1]  # the weights did change between steps
    for name, w in weights.items():
        assert torch.equal(w, ref_weights[name]), name


def test_cache_errors_are_one_line():
    with pytest.raises(ConfigError, match="needs precision.fp8"):
        load_config("tiny-qwen3", {"precision.fp8_weight_cache": "true"})
    cfg = load_config("tiny-qwen3", {"precision.fp8": "rowwise", "precision.fp8_weight_cache": "true"})
    layout = types.SimpleNamespace(dims=types.SimpleNamespace(edp=2))
    with pytest.raises(ConfigError, match="data_parallel=ddp"):
        refuse_weight_cache_over_fsdp(cfg, layout)
    refuse_weight_cache_over_fsdp(cfg, types.SimpleNamespace(dims=types.SimpleNamespace(edp=1)))


def test_experts_without_up_projection_cache_two_weights():
    """A one-input activation (no up projection): the cache holds gate's and down's operands."""
    scaling = grouped_scaling("rowwise")
    from moefold.moe.activation import ACTIVATIONS, PlainActivation

    experts = Fp8GroupedExperts(2, 32, 32, PlainActivation(ACTIVATIONS["gelu"]), EmulatedFp8GroupedGemm(), scaling,
                                weight_cache=CachedWeights(torch.float32))
    torch.nn.init.normal_(experts.w1_EDF)
    torch.nn.init.normal_(experts.w2_EFD)
    refresh_weight_caches(experts)
    assert experts.weight_names() == ["w1_EDF", "w2_EFD"]
    assert sorted(n for n, _ in experts.named_buffers()) == [
        "fp8_w1_EDF_forward_0", "fp8_w1_EDF_grad_input_0", "fp8_w2_EFD_forward_0", "fp8_w2_EFD_grad_input_0"]
    assert experts.state_dict().keys() == {"w1_EDF", "w2_EFD"}
    x = _rand((32, 32), 7)
    y = experts(x, torch.tensor([16, 16]))
    per_call = Fp8GroupedExperts(2, 32, 32, PlainActivation(ACTIVATIONS["gelu"]), EmulatedFp8GroupedGemm(), scaling)
    per_call.load_state_dict(experts.state_dict())
    assert torch.equal(y, per_call(x, torch.tensor([16, 16])))
