"""FP8 training on CPU through the emulation backend (moefold.fp8: linear, grouped, apply).

M tokens, K input features, N output features, R routed rows, E experts.
References quantize tile by tile with Python loops (no reshape tricks shared with recipes.py),
dequantize, and multiply in fp64.
"""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moefold.cli import main
from moefold.config import load_config
from moefold.errors import ConfigError
from moefold.fp8.apply import apply_fp8
from moefold.fp8.gemm import EmulatedFp8Gemm, HighPrecisionWeightGrad, ScaledMMFp8Gemm, linear_scaling, pad_rows
from moefold.fp8.grouped import (
    EmulatedFp8GroupedGemm,
    HighPrecisionGroupedWeightGrad,
    ScaledGroupedMMFp8Gemm,
    fp8_grouped_mm,
    fp8_grouped_mms,
    grouped_scaling,
)
from moefold.fp8.linear import Fp8Linear
from moefold.fp8.recipes import E4M3, E5M2, fake_quant
from moefold.fp8.saved import SaveFp8Input, SaveInput
from moefold.models.transformer import build_model
from moefold.moe.experts import Fp8GroupedExperts
from moefold.moe.router import Router

RECIPES = ["tensorwise", "rowwise", "blockwise"]
# The design restated, per recipe: (a tile, a format, b tile, b format) of each GEMM of a linear
# (forward: x @ W^T, grad_input: gy @ W, grad_weight: gy^T @ x). Tiles (rows, cols); 0 = whole dim.
LINEAR_TILES = {
    "tensorwise": {"forward": ((0, 0), E4M3, (0, 0), E4M3), "grad_input": ((0, 0), E5M2, (0, 0), E4M3),
                   "grad_weight": ((0, 0), E5M2, (0, 0), E4M3)},
    "rowwise": {g: ((1, 0), E4M3, (0, 1), E4M3) for g in ("forward", "grad_input", "grad_weight")},
    "blockwise": {"forward": ((1, 128), E4M3, (128, 128), E4M3),
                  "grad_input": ((1, 128), E4M3, (128, 128), E4M3),
                  "grad_weight": ((1, 128), E4M3, (128, 1), E4M3)},
}


def ref_fake_quant(x, tile, fmt):
    """Each tile scaled by amax/fp8_max, cast to FP8 (saturating), multiplied back; fp64 result."""
    rows, cols = x.shape
    tr, tc = tile[0] or rows, tile[1] or cols
    out = torch.empty(rows, cols, dtype=torch.float64)
    for i in range(0, rows, tr):
        for j in range(0, cols, tc):
            t = x[i:i + tr, j:j + tc].float()
            amax = t.abs().max()
            scale = amax / fmt.max if amax > 0 else torch.tensor(1.0)
            q = (t / scale).clamp(-fmt.max, fmt.max).to(fmt.dtype)
            out[i:i + tr, j:j + tc] = q.double() * scale.double()
    return out


def ref_gemm(a, b, spec):
    a_tile, a_fmt, b_tile, b_fmt = spec
    return ref_fake_quant(a, a_tile, a_fmt) @ ref_fake_quant(b, b_tile, b_fmt)


def rand(shape, seed, outliers=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if outliers:  # scaled rows and columns, so tile choice matters
        x = x * torch.exp2(torch.randint(-6, 6, (shape[0], 1), generator=g).float())
    return x


def assert_close64(actual, expected):
    # fp32 matmul of the dequantized operands vs fp64: only fp32 accumulation error remains.
    torch.testing.assert_close(actual.double(), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_linear_forward_backward_match_reference(recipe):
    M, K, N = 200, 256, 128  # M not a multiple of 128: blockwise grad_weight pads tokens with zeros
    x_MK = rand((M, K), 0).requires_grad_()
    linear = nn.Linear(K, N, bias=False)
    with torch.no_grad():
        linear.weight.copy_(rand((N, K), 1, outliers=False) * 0.05)
    fp8 = Fp8Linear.from_linear(linear, EmulatedFp8Gemm(), linear_scaling(recipe))
    assert fp8.weight is linear.weight
    y_MN = fp8(x_MK)
    gy_MN = rand((M, N), 2)
    y_MN.backward(gy_MN)

    tiles, w_NK, x = LINEAR_TILES[recipe], linear.weight.detach(), x_MK.detach()
    assert_close64(y_MN.detach(), ref_gemm(x, w_NK.t(), tiles["forward"]))
    assert_close64(x_MK.grad, ref_gemm(gy_MN, w_NK, tiles["grad_input"]))
    pad = -M % 128 if recipe == "blockwise" else 0
    x_pad, gy_pad = F.pad(x, (0, 0, 0, pad)), F.pad(gy_MN, (0, 0, 0, pad))
    assert_close64(linear.weight.grad, ref_gemm(gy_pad.t(), x_pad, tiles["grad_weight"]))
    # And the FP8 result is near the exact one (e4m3 operands: a few % relative error).
    exact = x.double() @ w_NK.double().t()
    assert (y_MN.detach().double() - exact).norm() / exact.norm() < 0.08


def test_fp8_linear_keeps_leading_dims_and_bias():
    linear = nn.Linear(32, 16, bias=True)
    fp8 = Fp8Linear.from_linear(linear, EmulatedFp8Gemm(), linear_scaling("rowwise"))
    x = torch.randn(2, 3, 32)
    y = fp8(x)
    assert y.shape == (2, 3, 16)
    torch.testing.assert_close(y, linear(x), rtol=0.1, atol=0.1)
    assert fp8.state_dict().keys() == linear.state_dict().keys()


def ref_grouped(x_RK, w_EKN, gy_RN, sizes, recipe):
    """Per-expert loop: forward, grad_x, grad_w with each expert's rows quantized on their own."""
    block = recipe == "blockwise"
    act, wt = ((1, 128), (128, 128)) if block else ((1, 0), (0, 1))
    wgrad = (128, 1) if block else (0, 1)  # along the expert's rows: per column of its group
    out, gx, gw, start = [], [], [], 0
    for e, n in enumerate(sizes):
        x, gy = x_RK[start:start + n], gy_RN[start:start + n]
        start += n
        out.append(ref_fake_quant(x, act, E4M3) @ ref_fake_quant(w_EKN[e], wt, E4M3))
        gx.append(ref_fake_quant(gy, act, E4M3) @ ref_fake_quant(w_EKN[e].t(), wt, E4M3))
        if n == 0:
            gw.append(torch.zeros(w_EKN.shape[1:], dtype=torch.float64))
        else:
            gw.append(ref_fake_quant(x, wgrad, E4M3).t() @ ref_fake_quant(gy, wgrad, E4M3))
    return torch.cat(out), torch.cat(gx), torch.stack(gw)


@pytest.mark.parametrize("recipe,sizes", [("rowwise", [32, 0, 48, 16]), ("blockwise", [128, 0, 256, 128])])
def test_fp8_grouped_mm_matches_per_expert_loop(recipe, sizes):
    E, K, N, unused = len(sizes), 128, 256, 16
    used = sum(sizes)
    x_RK = rand((used + unused, K), 3).requires_grad_()
    w_EKN = (torch.randn(E, K, N, generator=torch.Generator().manual_seed(4)) * 0.05).requires_grad_()
    offsets_E = torch.tensor(sizes).cumsum(0).to(torch.int32)
    y_RN = fp8_grouped_mm(x_RK, w_EKN, offsets_E, EmulatedFp8GroupedGemm(), grouped_scaling(recipe))
    gy_RN = torch.cat([rand((used, N), 5), torch.zeros(unused, N)])  # combine never reads unused rows
    y_RN.backward(gy_RN)
    out, gx, gw = ref_grouped(x_RK.detach(), w_EKN.detach(), gy_RN, sizes, recipe)
    assert_close64(y_RN.detach()[:used], out)
    assert_close64(x_RK.grad[:used], gx)
    assert_close64(w_EKN.grad, gw)


@pytest.mark.parametrize("fp8_saved", [False, True], ids=["input", "fp8-input"])
@pytest.mark.parametrize("weight_grad", ["fp8", "bf16"])
@pytest.mark.parametrize("recipe,sizes", [("rowwise", [32, 0, 48, 16]), ("blockwise", [128, 0, 256, 128])])
def test_gate_and_up_in_one_function_equal_one_call_each(recipe, sizes, weight_grad, fp8_saved):
    """fp8_grouped_mms (gate and up reading one x, which it quantizes and keeps once) gives the
    outputs and gradients of one fp8_grouped_mm per weight bit for bit, and keeps x once: with
    FP8 saved activations one FP8 copy where separate calls keep two. A frozen weight gets no
    gradient."""
    scaling = grouped_scaling(recipe)
    gemm = EmulatedFp8GroupedGemm()
    gemm = HighPrecisionGroupedWeightGrad(gemm) if weight_grad == "bf16" else gemm
    saver = SaveFp8Input(scaling.forward.a) if fp8_saved else SaveInput()
    E, K, N, used = len(sizes), 128, 256, sum(sizes)
    offsets_E = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x = rand((used + 16, K), 3)
    w1, w3 = (0.05 * rand((E, K, N), seed, outliers=False) for seed in (4, 6))
    g1, g3 = (torch.cat([rand((used, N), seed), torch.zeros(16, N)]) for seed in (5, 7))

    def run(joint: bool, frozen_w3: bool = False):
        xr, w1r, w3r = x.clone().requires_grad_(), w1.clone().requires_grad_(), w3.clone().requires_grad_(not frozen_w3)
        if joint:
            (y1, y3), saved = _saved_inputs(lambda: fp8_grouped_mms(xr, [w1r, w3r], offsets_E, gemm, scaling, saver))
        else:
            (y1, y3), saved = _saved_inputs(lambda: [fp8_grouped_mm(xr, w, offsets_E, gemm, scaling, saver)
                                                     for w in (w1r, w3r)])
        torch.autograd.backward([y1, y3], [g1, g3])
        kept_x = [t for t in saved if t.shape == x.shape]
        return [y1.detach()[:used], y3.detach()[:used], xr.grad[:used], w1r.grad, w3r.grad], kept_x

    (joint, kept_joint), (separate, kept_separate) = run(True), run(False)
    for a, b in zip(joint, separate):
        assert torch.equal(a, b)
    assert len(kept_joint) == 1 and len(kept_separate) == 2
    assert kept_joint[0].dtype == (torch.float8_e4m3fn if fp8_saved else x.dtype)
    frozen, _ = run(True, frozen_w3=True)
    assert frozen[4] is None and all(torch.equal(a, b) for a, b in zip(frozen[:4], joint[:4]))


def test_gate_and_up_function_traces_whole_under_compile():
    """Dynamo traces fp8_grouped_mms (an autograd Function with a tuple of outputs) in one graph,
    with and without grad, and the compiled results equal eager's."""
    scaling, gemm = grouped_scaling("rowwise"), EmulatedFp8GroupedGemm()
    sizes = [32, 0, 48, 16]
    offsets_E = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x = rand((sum(sizes), 64), 2).bfloat16()  # grouped_mm stays out of the graph outside bf16
    w1, w3 = ((0.05 * rand((4, 64, 32), seed, outliers=False)).bfloat16() for seed in (3, 4))

    def loss(x, w1, w3):
        y1, y3 = fp8_grouped_mms(x, [w1, w3], offsets_E, gemm, scaling)
        return (F.silu(y1) * y3).float().square().sum()

    grads, no_grad_losses = [], []
    for run in (loss, torch.compile(loss, backend="aot_eager", fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w3)]
        run(*leaves).backward()
        grads.append([t.grad for t in leaves])
        with torch.no_grad():  # validation: Dynamo inlines forward itself (it once dropped ctx here)
            no_grad_losses.append(run(x, w1, w3))
    for eager, compiled in zip(*grads):
        torch.testing.assert_close(compiled, eager, rtol=2 ** -7, atol=0)
    torch.testing.assert_close(no_grad_losses[1], no_grad_losses[0], rtol=2 ** -7, atol=0)


def test_tensorwise_experts_use_rowwise_grouped_scaling():
    assert grouped_scaling("tensorwise") == grouped_scaling("rowwise")


ALIGNED = {"model.dim": 128, "model.n_heads": 4, "model.ffn_hidden": 128, "moe.expert_hidden": 128,
           "moe.num_experts": 4, "moe.top_k": 2, "train.seq_len": 32, "train.micro_batch_size": 4}
DEEPSEEK = {**ALIGNED, "model.q_lora_rank": 128, "model.kv_lora_rank": 128, "moe.num_groups": 2,
            "moe.group_top_k": 1, "moe.group_score_top_k": 1}
QWEN3 = {**ALIGNED, "model.head_dim": 32, "model.n_kv_heads": 4}


def built(preset, overrides, recipe):
    cfg = load_config(preset, {**overrides, "precision.fp8": recipe})
    model = build_model(cfg, 256)
    model.init_weights(0)
    return cfg, model


def test_apply_fp8_converts_exactly_the_block_linears_and_experts():
    cfg, model = built("tiny-deepseek", DEEPSEEK, "rowwise")
    before = dict(model.named_modules())
    converted = apply_fp8(model, cfg.precision, "cpu")
    fp8_names = {n for n, m in model.named_modules() if isinstance(m, (Fp8Linear, Fp8GroupedExperts))}
    assert set(converted) == fp8_names
    # Every nn.Linear inside a block whose features are multiples of 16 (not MLA's wkv_a: 128 + 8
    # outputs), every experts module.
    aligned = lambda m: m.in_features % 16 == 0 and m.out_features % 16 == 0
    expected = {n for n, m in before.items() if (n.startswith(("layers.", "mtp.layers.0.block.")))
                and ((type(m) is nn.Linear and aligned(m)) or n.endswith("ffn.experts"))}
    assert "layers.0.attn.wkv_a" not in expected
    assert fp8_names == expected
    for name, module in model.named_modules():  # high precision: router, embeddings, head, norms
        if isinstance(module, Router) or name in ("tok_embeddings", "output", "norm", "mtp.layers.0.eh_proj"):
            assert module is before[name]
    for layer in model.moe_layers():
        assert layer.dispatcher.layout.multiple == 16
        assert isinstance(layer.experts, Fp8GroupedExperts)
    # Parameters are the same objects: optimizer, checkpoints and init see no difference.
    assert {id(p) for p in model.parameters()} == {id(p) for m in [before[""]] for p in m.parameters()}


def test_apply_fp8_exclusions_first_last_layers_and_alignment():
    overrides = {**DEEPSEEK, "model.n_layers": 4, "precision.fp8_bf16_first_layers": 1,
                 "precision.fp8_bf16_last_layers": 1, "precision.fp8_exclude": '["*.attn.*", "mtp.*"]'}
    cfg, model = built("tiny-deepseek", overrides, "blockwise")
    converted = apply_fp8(model, cfg.precision, "cpu")
    assert converted and all(n.startswith(("layers.1.", "layers.2.")) for n in converted)
    assert not any(".attn." in n for n in converted)
    # MoE layers 1, 2, 3 and MTP's: only the FP8 ones pad their experts' rows.
    assert [layer.dispatcher.layout.multiple for layer in model.moe_layers()] == [128, 128, 1, 1]
    # Experts kept in bf16 keep their layer's padding as it was; the layer's linears still convert.
    cfg, model = built("tiny-qwen3", {**QWEN3, "precision.fp8_exclude": '["layers.0.ffn.experts"]'}, "rowwise")
    apply_fp8(model, cfg.precision, "cpu")
    assert [layer.dispatcher.layout.multiple for layer in model.moe_layers()][:2] == [1, 16]
    assert isinstance(model.layers[0].attn.wq, Fp8Linear)
    # A linear not a multiple of the blockwise tile (128) stays nn.Linear.
    cfg, model = built("tiny-qwen3", {**QWEN3, "model.n_kv_heads": 2}, "blockwise")
    apply_fp8(model, cfg.precision, "cpu")
    assert type(model.layers[0].attn.wk) is nn.Linear and isinstance(model.layers[0].attn.wq, Fp8Linear)


def test_unaligned_experts_are_refused_in_one_line_with_the_way_out(tmp_path):
    """Blockwise tiles the experts' features by 128: tiny-qwen3's 64/32 are refused before anything
    is written (exit 2), and fp8_exclude, the way out the message names, keeps them in bf16."""
    cfg, model = built("tiny-qwen3", {}, "blockwise")
    with pytest.raises(ConfigError, match=r"^precision.fp8=blockwise needs model.dim \(64\) and "
                                          r"moe.expert_hidden \(32\) to be multiples of 128") as err:
        apply_fp8(model, cfg.precision, "cpu")
    assert "\n" not in str(err.value) and "fp8_exclude" in str(err.value)
    run = tmp_path / "run"
    assert main(["train", "--config", "tiny-qwen3", "--run-dir", str(run), "--precision.fp8", "blockwise"]) == 2
    assert not (run / "metrics.jsonl").exists()
    cfg, model = built("tiny-qwen3", {"precision.fp8_exclude": '["*.experts"]'}, "blockwise")
    apply_fp8(model, cfg.precision, "cpu")  # no error; the (unaligned) experts stay as they were
    assert not any(isinstance(m, Fp8GroupedExperts) for m in model.modules())


@pytest.mark.parametrize("weight_grad", ["fp8", "bf16"])
def test_fp8_emulate_picks_the_emulation_on_cuda(weight_grad):
    """precision.fp8_emulate swaps CUDA's kernels for the emulation in every FP8 module (built for
    "cuda" without a GPU: choosing a backend touches no device), keeping the weight-gradient mode."""
    overrides = {**QWEN3, "precision.fp8_grouped_gemm": "cutlass", "precision.fp8_weight_grad": weight_grad}
    kinds = {}
    for emulate in (False, True):
        cfg, model = built("tiny-qwen3", {**overrides, "precision.fp8_emulate": emulate}, "rowwise")
        apply_fp8(model, cfg.precision, "cuda")
        gemms = [m.gemm for m in model.modules() if isinstance(m, (Fp8Linear, Fp8GroupedExperts))]
        if weight_grad == "bf16":
            assert {type(g) for g in gemms} == {HighPrecisionWeightGrad, HighPrecisionGroupedWeightGrad}
            gemms = [g.inner for g in gemms]
        kinds[emulate] = {type(g) for g in gemms}
    assert kinds[False] == {ScaledMMFp8Gemm, ScaledGroupedMMFp8Gemm}
    assert kinds[True] == {EmulatedFp8Gemm, EmulatedFp8GroupedGemm}


def test_apply_fp8_off_changes_nothing_and_bad_pattern_is_one_line():
    cfg, model = built("tiny-qwen3", QWEN3, "off")
    before = [(n, type(m)) for n, m in model.named_modules()]
    assert apply_fp8(model, cfg.precision, "cpu") == []
    assert [(n, type(m)) for n, m in model.named_modules()] == before
    cfg, model = built("tiny-qwen3", {**QWEN3, "precision.fp8_exclude": '["layer.*"]'}, "rowwise")
    with pytest.raises(ConfigError, match=r"^precision.fp8_exclude: pattern 'layer\.\*' matches no module"):
        apply_fp8(model, cfg.precision, "cpu")


@pytest.mark.parametrize("overrides,message", [
    ({"precision.fp8": "fp4"}, "precision.fp8='fp4' is not one of off, tensorwise, rowwise, blockwise"),
    ({"precision.fp8_grouped_gemm": "cublas"}, "precision.fp8_grouped_gemm='cublas' is not one of cutlass, triton"),
    ({"precision.fp8_weight_grad": "fp16"}, "precision.fp8_weight_grad='fp16' is not one of fp8, bf16"),
    ({"precision.fp8_bf16_last_layers": -1}, "precision.fp8_bf16_last_layers=-1 must be >= 0"),
    ({"precision.fp8_bf16_first_layers": 3},
     "precision.fp8_bf16_first_layers=3 exceeds model.n_layers=2; allowed: 0 to 2"),
    ({"precision.fp8_bf16_last_layers": 3, "model.n_layers": 1},
     "precision.fp8_bf16_last_layers=3 exceeds model.n_layers=1; allowed: 0 to 1"),
])
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        load_config("tiny-qwen3", overrides)
    assert "\n" not in str(err.value)


def train_losses(preset, overrides, recipe, steps=30, apply=True):
    cfg, model = built(preset, overrides, recipe)
    if apply:
        apply_fp8(model, cfg.precision, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(0, 256, (16, 33), generator=torch.Generator().manual_seed(0))
    losses = []
    for step in range(steps):
        batch = data[(torch.arange(4) + 4 * step) % 16]
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256).float(), batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def assert_learns_like_fp32(losses: list[float], ref: list[float], what: str) -> None:
    """FP8 against fp32 on a memorisation task (16 random sequences, Adam lr 3e-3, 30 steps). Each
    FP8 GEMM has a 2.5-3.5% relative error (docs/fp8.md), so the runs drift apart step by step,
    and where the loss is still mid-descent at step 30 (the tiny DeepSeek's, ~1 nat learned of
    5.55) a rounding that flips a routing choice moves the rest of the curve. Measured over init
    seeds 0-3, every recipe: the first ten losses within 4.1% of fp32's; the drop to the last ten's
    mean 0.88-1.69 of fp32's for DeepSeek, 0.99-1.02 for Qwen3 (3.6 nats). Bounds: 6%, and at least
    70% of fp32's drop; a recipe that does not learn, or learns from wrong gradients, fails."""
    early = max(abs(a / b - 1) for a, b in zip(losses[:10], ref[:10], strict=True))
    assert early < 0.06, f"{what}: a loss of the first ten steps {early:.1%} away from fp32's"
    drop, ref_drop = losses[0] - sum(losses[-10:]) / 10, ref[0] - sum(ref[-10:]) / 10
    assert ref_drop > 0.5, f"fp32 learned only {ref_drop:.2f} nats"
    assert drop > 0.7 * ref_drop, f"{what}: learned {drop:.2f} nats, fp32 {ref_drop:.2f}"


@pytest.mark.parametrize("preset,overrides", [("tiny-qwen3", QWEN3), ("tiny-deepseek", DEEPSEEK)])
def test_tiny_models_train_in_fp8_like_fp32(preset, overrides):
    ref = train_losses(preset, overrides, "off")
    assert ref == train_losses(preset, overrides, "off", apply=False)  # fp8=off: bit-identical
    for recipe in RECIPES:
        assert_learns_like_fp32(train_losses(preset, overrides, recipe), ref, recipe)


def test_trainer_applies_fp8(tmp_path, tiny_args):
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "3",
                 "--precision.fp8", "rowwise", "--checkpoint.save_at_end", "false"]) == 0
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_compiled_fp8_linear_gradients_equal_eager(compute_dtype):
    """The cuBLAS backend (`torch._scaled_mm`, tensorwise: the recipe its CPU kernel runs) under
    torch.compile: the same gradients as eager. On torch 2.11 its no-op `.to(out_dtype)` at the end
    of forward made them zero (pytorch#180642), which trained every compiled FP8 run on the H200
    without gradients through its linears and experts."""
    from moefold.fp8.gemm import ScaledMMFp8Gemm

    torch.manual_seed(0)
    base = nn.Linear(64, 32, bias=False)
    lin = Fp8Linear.from_linear(base, ScaledMMFp8Gemm(), linear_scaling("tensorwise"))
    x = torch.randn(2, 16, 64).to(compute_dtype)
    gy = torch.randn(2, 16, 32).to(compute_dtype)
    grads = []
    for run in (lin, torch.compile(lin, backend="aot_eager", fullgraph=True)):
        torch._dynamo.reset()
        xr = x.clone().requires_grad_()
        base.weight.grad = None
        run(xr).backward(gy)
        grads.append((xr.grad, base.weight.grad))
    for g, e in zip(*reversed(grads)):
        assert g.abs().sum() > 0
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def _saved_inputs(fn):
    """Run fn() (a forward) and return the tensors autograd saved for backward."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return out, saved


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_saved_activations_keep_the_forward_fp8_input(recipe):
    """precision.fp8_saved_activations: Fp8Linear keeps x as the forward's FP8 tiles (1 byte per
    element plus scales, not the compute dtype's 4 here); grad_input is unchanged (it never reads
    x), and grad_weight is the GEMM of the dequantized saved x — the plain run's within FP8 noise."""
    M, K, N = 64, 256, 128
    scaling = linear_scaling(recipe)
    base = nn.Linear(K, N, bias=False)
    x, gy = rand((M, K), 0), torch.randn(M, N, generator=torch.Generator().manual_seed(1))
    grads = {}
    for saver in (SaveInput(), SaveFp8Input(scaling.forward.a)):
        lin = Fp8Linear.from_linear(base, EmulatedFp8Gemm(), scaling, saver)
        xr = x.clone().requires_grad_()
        base.weight.grad = None
        y, saved = _saved_inputs(lambda lin=lin, xr=xr: lin(xr))
        y.backward(gy)
        grads[saver.name] = (xr.grad, base.weight.grad.clone(), saved)
    (gx, gw, saved), (gx8, gw8, saved8) = grads["input"], grads["fp8"]
    assert any(t.dtype == torch.float32 and t.shape == (M, K) for t in saved)
    assert not any(t.shape == (M, K) and t.dtype != torch.float8_e4m3fn for t in saved8)
    assert any(t.dtype == torch.float8_e4m3fn and t.shape == (M, K) for t in saved8)
    assert torch.equal(gx8, gx)
    x_saved = fake_quant(x, scaling.forward.a, torch.float32)
    m = scaling.row_multiple
    expected = EmulatedFp8Gemm().mm(pad_rows(gy, m).t(), pad_rows(x_saved, m), scaling.grad_weight, torch.float32)
    torch.testing.assert_close(gw8, expected, rtol=0, atol=0)
    assert ((gw8 - gw).norm() / gw.norm()).item() < 0.1


def test_fp8_saved_activations_in_the_experts():
    """The grouped experts keep their inputs in FP8 too (rows tiles); grad_input is unchanged."""
    scaling = grouped_scaling("rowwise")
    sizes = [32, 0, 48, 16]
    offsets_E = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x, w = rand((sum(sizes) + 5, 64), 2), 0.05 * rand((4, 64, 32), 3, outliers=False)
    gy = torch.randn(sum(sizes) + 5, 32, generator=torch.Generator().manual_seed(4))
    results = []
    for saver in (SaveInput(), SaveFp8Input(scaling.forward.a)):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y, saved = _saved_inputs(lambda xr=xr, wr=wr, saver=saver: fp8_grouped_mm(
            xr, wr, offsets_E, EmulatedFp8GroupedGemm(), scaling, saver))
        y.backward(gy)
        results.append((xr.grad, wr.grad, [t.dtype for t in saved if t.shape == x.shape]))
    (gx, gw, kept), (gx8, gw8, kept8) = results
    assert kept == [torch.float32] and kept8 == [torch.float8_e4m3fn]
    rows = sum(sizes)  # past the last group torch._grouped_mm leaves its output unwritten
    assert torch.equal(gx8[:rows], gx[:rows])
    assert ((gw8 - gw).norm() / gw.norm()).item() < 0.1


@pytest.mark.parametrize("preset,overrides", [("tiny-qwen3", QWEN3), ("tiny-deepseek", DEEPSEEK)])
def test_tiny_models_train_with_fp8_saved_activations(preset, overrides):
    """Rowwise FP8 with FP8-saved inputs learns like fp32, by the same rule as without."""
    ref = train_losses(preset, overrides, "off")
    losses = train_losses(preset, {**overrides, "precision.fp8_saved_activations": "true"}, "rowwise")
    assert_learns_like_fp32(losses, ref, "rowwise, fp8 saved activations")


@pytest.mark.parametrize("recipe", RECIPES)
def test_bf16_weight_grad_linear(recipe):
    """precision.fp8_weight_grad=bf16: forward and grad_input are the FP8 backend's, bit for bit;
    grad_weight is grad_y^T x unquantized (fp64 reference), not the FP8 one."""
    M, K, N = 200, 256, 128
    base = nn.Linear(K, N, bias=False)
    x, gy = rand((M, K), 0), rand((M, N), 2)
    out = {}
    for gemm in (EmulatedFp8Gemm(), HighPrecisionWeightGrad(EmulatedFp8Gemm())):
        lin = Fp8Linear.from_linear(base, gemm, linear_scaling(recipe))
        xr = x.clone().requires_grad_()
        base.weight.grad = None
        y = lin(xr)
        y.backward(gy)
        out[gemm.name] = (y.detach(), xr.grad, base.weight.grad.clone())
    (y, gx, gw_fp8), (y_hp, gx_hp, gw_hp) = out["emulated"], out["emulated, bf16 grad_weight"]
    assert torch.equal(y_hp, y) and torch.equal(gx_hp, gx)
    assert_close64(gw_hp, gy.double().t() @ x.double())
    assert not torch.allclose(gw_hp, gw_fp8, rtol=1e-3, atol=0)


def test_bf16_weight_grad_experts():
    """The experts' form: FP8 forward and grad_input unchanged, each expert's weight gradient its
    rows' x_e^T gy_e unquantized (per-expert loop in fp64; an empty expert's is zero)."""
    sizes, K, N = [32, 0, 48, 16], 128, 64
    offsets_E = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x, w = rand((sum(sizes) + 5, K), 2), 0.05 * rand((4, K, N), 3, outliers=False)
    gy = torch.cat([rand((sum(sizes), N), 4), torch.zeros(5, N)])
    results = []
    for gemm in (EmulatedFp8GroupedGemm(), HighPrecisionGroupedWeightGrad(EmulatedFp8GroupedGemm())):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8_grouped_mm(xr, wr, offsets_E, gemm, grouped_scaling("rowwise"))
        y.backward(gy)
        results.append((y.detach(), xr.grad, wr.grad))
    (y, gx, gw_fp8), (y_hp, gx_hp, gw_hp) = results
    rows = sum(sizes)
    assert torch.equal(y_hp[:rows], y[:rows]) and torch.equal(gx_hp[:rows], gx[:rows])
    starts = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    ref = torch.stack([x[a:b].double().t() @ gy[a:b].double() for a, b in zip(starts, starts[1:])])
    assert_close64(gw_hp, ref)
    assert not torch.allclose(gw_hp, gw_fp8, rtol=1e-3, atol=0)


@pytest.mark.parametrize("preset,overrides", [("tiny-qwen3", QWEN3), ("tiny-deepseek", DEEPSEEK)])
def test_tiny_models_train_with_bf16_weight_grad(preset, overrides):
    """apply_fp8 builds the high-precision weight-gradient backends, and the model learns like fp32
    by the same rule as the FP8 weight gradients' run."""
    cfg, model = built(preset, {**overrides, "precision.fp8_weight_grad": "bf16"}, "rowwise")
    apply_fp8(model, cfg.precision, "cpu")
    gemms = {type(m.gemm) for m in model.modules() if isinstance(m, (Fp8Linear, Fp8GroupedExperts))}
    assert gemms == {HighPrecisionWeightGrad, HighPrecisionGroupedWeightGrad}
    ref = train_losses(preset, overrides, "off")
    losses = train_losses(preset, {**overrides, "precision.fp8_weight_grad": "bf16"}, "rowwise")
    assert_learns_like_fp32(losses, ref, "rowwise, bf16 weight gradients")


@pytest.mark.parametrize("preset,overrides,param_dtype", [
    ("tiny-qwen3", QWEN3, ""), ("tiny-qwen3", QWEN3, "fp32"), ("tiny-deepseek", DEEPSEEK, "")])
def test_fp8_saved_activations_never_keep_more(preset, overrides, param_dtype):
    """precision.fp8_saved_activations keeps less for backward than plain FP8, and no module kind
    keeps more: counted on the real model (plan.measure, bf16 under FakeTensorMode) with bf16
    parameters (q/k/v share one input, which stays bf16) and with fp32 parameters under autocast
    (each linear casts its own input; FP8 halves each). Before the sibling rule q/k/v kept three
    FP8 copies of one bf16 input: attention projections 65,536 → 135,168 bytes."""
    from moefold.plan.measure import measure_saved_activations

    base = {**overrides, "train.seq_len": 64, "train.micro_batch_size": 2, "precision.fp8": "rowwise"}
    plain = measure_saved_activations(load_config(preset, base), "bf16", param_dtype=param_dtype)
    saved = measure_saved_activations(load_config(preset, {**base, "precision.fp8_saved_activations": "true"}),
                                      "bf16", param_dtype=param_dtype)
    assert saved.total < plain.total
    for category, nbytes in saved.by_category.items():
        assert nbytes <= plain.by_category[category], category
    assert saved.by_category["experts"] < plain.by_category["experts"]  # w2's input in FP8


@pytest.mark.parametrize("q_lora_rank", [0, 32])
def test_fp8_saved_inputs_follow_the_sequence_parallel_mla(q_lora_rank):
    """MLA on a sequence shard without q-LoRA (parallel/tensor.py): wq all-gathers its own x and
    wkv_a reads the rank's rows, so neither shares its input and precision.fp8_saved_activations
    keeps both in FP8. Unsharded, and with q-LoRA (wq_a and wkv_a read the rank's rows together),
    they stay siblings that keep their one bf16 input; MTP blocks are never sequence-parallel."""
    cfg = load_config("tiny-deepseek", {"model.q_lora_rank": q_lora_rank, "model.qk_rope_head_dim": 16,  # wkv_a
                                        "precision.fp8": "rowwise", "precision.fp8_saved_activations": True})
    for sequence_parallel in (False, True):
        model = build_model(cfg, vocab_size=64)
        apply_fp8(model, cfg.precision, "cpu", sequence_parallel=sequence_parallel)
        first = ("wq", "wkv_a") if q_lora_rank == 0 else ("wq_a", "wkv_a")
        for block, on_shard in ((model.layers[0], sequence_parallel), (model.mtp.layers[0].block, False)):
            kept_fp8 = [isinstance(getattr(block.attn, name).saver, SaveFp8Input) for name in first]
            assert kept_fp8 == [on_shard and q_lora_rank == 0] * 2, (sequence_parallel, first)


def test_the_alignment_checked_is_the_etp_slice(tmp_path):
    """Under parallel.etp the grouped FP8 GEMMs run on each rank's slice of the experts' hidden
    features: experts whose slice is not a multiple of the recipe's tile are refused in one line. Checking the whole features crashed every rank's
    first forward ('128x128 e4m3 operand has 64 columns ... not a multiple of the 128x128
    quantization tile'; tiny-qwen3 at dim 128, expert_hidden 128, blockwise, tp 2 or etp 2)."""
    cfg, model = built("tiny-qwen3", {**QWEN3, "moe.expert_hidden": 256}, "blockwise")
    apply_fp8(model, cfg.precision, "cpu", etp=2)
    assert isinstance(model.layers[0].ffn.experts, Fp8GroupedExperts)  # 256 / 2 = 128
    cfg, model = built("tiny-qwen3", QWEN3, "blockwise")
    with pytest.raises(ConfigError, match=r"^precision.fp8=blockwise needs model.dim \(128\) and moe.expert_hidden "
                                          r"/ parallel.etp \(128 / 2 = 64\) to be multiples of 128"):
        apply_fp8(model, cfg.precision, "cpu", etp=2)
    run = tmp_path / "run"  # the trainer hands the layout's etp (on 2 gloo ranks)
    args = ["train", "--config", "tiny-qwen3", "--run-dir", str(run), "--precision.fp8", "blockwise",
            "--parallel.etp", "2", "--nproc", "2", "--train.device", "cpu",
            *[arg for key, value in QWEN3.items() for arg in (f"--{key}", str(value))]]
    assert main(args) == 2
    assert not (run / "metrics.jsonl").exists()


def test_a_linear_whose_tp_shard_is_unaligned_stays_bf16(tmp_path):
    """Under parallel.tp each rank's FP8 GEMM tiles its shard: a column-wise linear's share of the
    output features, a row-wise one's of the input features. A linear whose shard is not a
    multiple of the tile stays nn.Linear, as an unaligned linear does; checking the whole
    features crashed every rank's first forward (blockwise, tiny-qwen3 at dim 128, tp 2: '128x128
    e4m3 operand has 64 columns ((128, 64)), not a multiple of the 128x128 quantization tile')."""
    wide = {**QWEN3, "model.n_heads": 8, "model.ffn_hidden": 256, "moe.first_k_dense": 1}
    cfg, model = built("tiny-qwen3", wide, "blockwise")
    converted = set(apply_fp8(model, cfg.precision, "cpu", tp=2))
    # wq 128 -> 256 and w1/w3 128 -> 256 column-wise, wo 256 -> 128 and w2 256 -> 128 row-wise:
    # 128 a rank either way; wk/wv 128 -> 128 leave 64 output features a rank
    fp8 = {f"layers.0.{name}" for name in ("attn.wq", "attn.wo", "ffn.w1", "ffn.w3", "ffn.w2")}
    assert fp8 <= converted
    assert not {"layers.0.attn.wk", "layers.0.attn.wv"} & converted
    assert type(model.layers[0].attn.wk) is nn.Linear
    cfg, model = built("tiny-qwen3", wide, "blockwise")
    assert {"layers.0.attn.wk", "layers.0.attn.wv"} <= set(apply_fp8(model, cfg.precision, "cpu"))
    run = tmp_path / "run"  # the trainer hands the layout's tp (2 gloo ranks): trains, emulated
    args = ["train", "--config", "tiny-qwen3", "--run-dir", str(run), "--precision.fp8", "blockwise",
            "--parallel.tp", "2", "--nproc", "2", "--train.device", "cpu", "--train.steps", "2",
            "--train.warmup_steps", "0", *[arg for key, value in QWEN3.items() for arg in (f"--{key}", str(value))]]
    assert main(args) == 0
    assert len((run / "metrics.jsonl").read_text().splitlines()) >= 2
