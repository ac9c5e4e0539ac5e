"""An audit of the FP8 CPU path (moefold.fp8) against references written from the recipes'
definitions, sharing nothing with recipes.py but the FP8 dtypes: each format's largest value is
torch's (`fp8_max`), not the library's constant.

M tokens, K input features, N output features, E experts, R routed rows.
References: fp64 tile-by-tile quantization (scale = amax / fp8_max, 1 for an all-zero tile, values
clamped to ±fp8_max before the cast); power-of-two rescalings that a recipe's scales must absorb
exactly along the dims they run along (and cannot along the contraction); a bf16 model that the
excluded modules of an FP8 model must equal bit for bit.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moefold.config import load_config
from moefold.errors import ConfigError
from moefold.fp8.apply import apply_fp8
from moefold.fp8.gemm import EmulatedFp8Gemm, linear_scaling
from moefold.fp8.grouped import EmulatedFp8GroupedGemm, fp8_grouped_mm, grouped_scaling
from moefold.fp8.linear import Fp8Linear
from moefold.fp8.recipes import E4M3, E5M2, Operand, quantize
from moefold.models.transformer import build_model

RECIPES = ["tensorwise", "rowwise", "blockwise"]
# Tile (rows, cols) of each kind over the last two dims; 0 = the whole dim.
TILES = {"tensor": (0, 0), "row": (1, 0), "col": (0, 1), "1x128": (1, 128), "128x1": (128, 1),
         "128x128": (128, 128)}


def fp8_max(fmt) -> float:
    """The format's largest finite value, from torch rather than recipes.py."""
    return torch.finfo(fmt.dtype).max


def ref_quantize(x, tile, fmt):
    """(FP8 values as fp64, per-tile scales) by the definition, in fp64, one tile at a time."""
    top = fp8_max(fmt)
    x64 = x.double()
    rows, cols = x.shape
    tr, tc = tile[0] or rows, tile[1] or cols
    q = torch.empty_like(x64)
    scale = torch.empty(rows // tr, cols // tc, dtype=torch.float64)
    for i in range(0, rows, tr):
        for j in range(0, cols, tc):
            t = x64[i:i + tr, j:j + tc]
            amax = t.abs().max()
            s = amax / top if amax > 0 else torch.tensor(1.0, dtype=torch.float64)
            scale[i // tr, j // tc] = s
            q[i:i + tr, j:j + tc] = (t / s).clamp(-top, top).to(fmt.dtype).double()
    return q, scale


def tensor_with_extremes(shape, magnitude, seed):
    """Gaussian values times `magnitude`, each row scaled by 2^U{-10..10}, with an all-zero row and
    an all-zero column (zero tiles in every tiling)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * magnitude
    x = x * torch.exp2(torch.randint(-10, 11, (shape[0], 1), generator=g).float())
    x[3], x[:, 5] = 0.0, 0.0
    return x


@pytest.mark.parametrize("magnitude", [1e-25, 1e-3, 1.0, 1e4, 1e25])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("kind", list(TILES))
def test_quantize_is_the_fp64_definition_per_tile(kind, fmt, magnitude):
    """Each tile's scale is its amax / fp8_max (to fp32 rounding), along the dims the kind names;
    the FP8 values are x / scale rounded to the format; all-zero tiles get a scale of 1, not 0, inf
    or NaN; shapes not a multiple of 128 work for the kinds without 128-tiles."""
    shape = (256, 384) if "128" in kind else (37, 200)
    x = tensor_with_extremes(shape, magnitude, seed=len(kind))
    x_fp8, scale = quantize(x, Operand(kind, fmt))
    q_ref, scale_ref = ref_quantize(x, TILES[kind], fmt)
    assert x_fp8.dtype == fmt.dtype and scale.shape == scale_ref.shape
    assert torch.isfinite(scale).all() and (scale > 0).all()
    torch.testing.assert_close(scale.double(), scale_ref, rtol=2 ** -22, atol=0)
    q = x_fp8.double()
    assert q.abs().max() == fp8_max(fmt)  # every non-zero tile's amax lands on the format's max
    # fp32 x / scale against fp64: a value within 2^-23 of a rounding tie may round the other way.
    differ = q != q_ref
    assert differ.double().mean() < 1e-3
    assert ((q - q_ref).abs()[differ] <= q_ref.abs()[differ] * 2.0 ** -fmt.mantissa_bits + 2.0 ** -9).all()
    zero_tiles = scale_ref == 1.0
    assert torch.equal(scale.double()[zero_tiles], scale_ref[zero_tiles])


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_a_tile_whose_scale_is_subnormal_saturates_at_the_format_max_not_nan(fmt):
    """An fp32 amax of ~1e-42 gives a subnormal scale of one or two 2^-149 steps, so x / scale
    can land far above fp8_max (x / 2^-149 = 667 for e4m3 at amax 9.5e-43); e4m3fn casts that
    to NaN: the clamp must saturate it instead."""
    for amax in (9.5e-43, 6.3e-43, fp8_max(fmt) * 2.0 ** -149 * 1.49):
        x = torch.full((128, 128), amax / 2)
        x[0, 0] = amax
        for kind in TILES:
            x_fp8, scale = quantize(x, Operand(kind, fmt))
            q = x_fp8.float()
            assert not q.isnan().any() and q.abs().max() <= fp8_max(fmt), (kind, amax)
            assert (scale > 0).all() and torch.isfinite(scale).all()


# ---------------------------------------------------------------- which dims the scales run along


def pow2(n, seed, blocks=1):
    """2^U{-8..8} per index, constant over `blocks` consecutive indices."""
    g = torch.Generator().manual_seed(seed)
    return torch.exp2(torch.randint(-8, 9, (-(-n // blocks),), generator=g).float()).repeat_interleave(blocks)[:n]


def fp8_linear_grads(recipe, x_MK, w_NK, gy_MN):
    linear = nn.Linear(w_NK.shape[1], w_NK.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(w_NK)
    fp8 = Fp8Linear.from_linear(linear, EmulatedFp8Gemm(), linear_scaling(recipe))
    x = x_MK.clone().requires_grad_()
    y = fp8(x)
    y.backward(gy_MN)
    return y.detach(), x.grad, linear.weight.grad


# Per recipe, the block size along each dim that a power-of-two rescaling must be exact over
# (1: any index by itself; None: only the whole dim), for: x's rows (tokens, forward), W's rows
# (output features, forward), gy's rows (grad_input), W's columns (input features, grad_input),
# gy's columns and x's columns (grad_weight).
EXACT_BLOCKS = {
    "tensorwise": dict(x_rows=None, w_rows=None, gy_rows=None, w_cols=None, gy_cols=None, x_cols=None),
    "rowwise": dict(x_rows=1, w_rows=1, gy_rows=1, w_cols=1, gy_cols=1, x_cols=1),
    "blockwise": dict(x_rows=1, w_rows=128, gy_rows=1, w_cols=128, gy_cols=1, x_cols=1),
}


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_gemm_scales_along_the_recipes_dims_forward_dgrad_wgrad(recipe):
    """Scales run along the dims the recipe says, in all three GEMMs: rescaling an operand by a
    power of two per index (or per 128-block, or as a whole) along a dim its scales run along
    rescales the result exactly (the scale absorbs it, the FP8 values stay); along the contraction
    (K for the forward, N for grad_input, M for grad_weight) it cannot, and does not."""
    M, K, N = 200, 256, 384  # M not a multiple of 16 or 128: grad_weight pads the tokens
    g = torch.Generator().manual_seed(0)
    x, w, gy = (torch.randn(shape, generator=g) for shape in ((M, K), (N, K), (M, N)))
    y0, gx0, gw0 = fp8_linear_grads(recipe, x, w, gy)
    blocks = EXACT_BLOCKS[recipe]

    def factor(n, seed, key):
        b = blocks[key]
        return torch.full((n,), 4.0) if b is None else pow2(n, seed, b)

    rx, rw = factor(M, 1, "x_rows"), factor(N, 2, "w_rows")
    y, _, _ = fp8_linear_grads(recipe, x * rx[:, None], w * rw[:, None], gy)
    assert torch.equal(y, y0 * rx[:, None] * rw[None, :])
    rg, cw = factor(M, 3, "gy_rows"), factor(K, 4, "w_cols")
    _, gx, _ = fp8_linear_grads(recipe, x, w * cw[None, :], gy * rg[:, None])
    assert torch.equal(gx, gx0 * rg[:, None] * cw[None, :])
    cg, cx = factor(N, 5, "gy_cols"), factor(K, 6, "x_cols")
    _, _, gw = fp8_linear_grads(recipe, x * cx[None, :], w, gy * cg[None, :])
    assert torch.equal(gw, gw0 * cg[:, None] * cx[None, :])
    # Along the contraction, rescalings that cancel in the exact product change the FP8 one: the
    # values of one tile are rescaled differently.
    y, _, _ = fp8_linear_grads(recipe, x * pow2(K, 7)[None, :], w / pow2(K, 7)[None, :], gy)
    assert not torch.equal(y, y0)
    _, gx, _ = fp8_linear_grads(recipe, x, w * pow2(N, 8)[:, None], gy / pow2(N, 8)[None, :])
    assert not torch.equal(gx, gx0)
    _, _, gw = fp8_linear_grads(recipe, x * pow2(M, 9)[:, None], w, gy / pow2(M, 9)[:, None])
    assert not torch.equal(gw, gw0)


@pytest.mark.parametrize("recipe,grad_fmt", [("tensorwise", E5M2), ("rowwise", E4M3), ("blockwise", E4M3)])
def test_gradients_are_quantized_in_the_recipes_format(recipe, grad_fmt):
    """grad_input quantizes the output gradient in e5m2 (tensorwise) or e4m3 (rowwise,
    blockwise): a value 1.3 · 2^-10 of its tile's amax becomes 80 / 57344 of it in e5m2 (72.8
    scaled, 2 mantissa bits) and 0.5625 / 448 in e4m3 (0.569 scaled, 3 bits); the weight, an
    identity, passes it through exactly."""
    M, K, N = 128, 128, 128
    x, w = torch.eye(M, K), torch.eye(N, K)
    gy = torch.zeros(M, N)
    gy[0, 0], gy[0, 1] = 1.0, 2.0 ** -10 * 1.3  # 1.3: not a multiple of e4m3's subnormal step
    _, gx, _ = fp8_linear_grads(recipe, x, w, gy)
    q, _ = ref_quantize(torch.tensor([[1.0, 2.0 ** -10 * 1.3]]), (1, 0), grad_fmt)
    assert gx[0, 1].item() == pytest.approx(q[0, 1].item() / fp8_max(grad_fmt), rel=1e-6)


def fp8_grouped_grads(recipe, x_RK, w_EKN, gy_RN, offsets_E):
    x, w = x_RK.clone().requires_grad_(), w_EKN.clone().requires_grad_()
    y = fp8_grouped_mm(x, w, offsets_E, EmulatedFp8GroupedGemm(), grouped_scaling(recipe))
    y.backward(gy_RN)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("recipe,sizes,block", [("rowwise", [32, 0, 48, 16], 1), ("blockwise", [128, 0, 256, 128], 128)])
def test_each_grouped_gemm_scales_along_the_recipes_dims_within_each_expert(recipe, sizes, block):
    """The experts' three grouped GEMMs absorb power-of-two rescalings exactly along their scaled
    dims: rows of x and of the gradient (forward, grad_input), each expert's weight per column
    (or 128-block) for the forward and per row (or 128-block) for grad_input, and, for the weight
    gradient, x's and the gradient's columns rescaled differently in every expert's rows: its
    scales run per column within each expert (an amax over all rows would mix the experts)."""
    E, K, N, used = len(sizes), 256, 384, sum(sizes)
    R = used + 16  # rows past the last group, never read
    g = torch.Generator().manual_seed(0)
    x, w, gy = torch.randn(R, K, generator=g), torch.randn(E, K, N, generator=g), torch.randn(R, N, generator=g)
    offsets_E = torch.tensor(sizes).cumsum(0).to(torch.int32)
    expert_R = torch.cat([torch.repeat_interleave(torch.arange(E), torch.tensor(sizes)), torch.full((16,), E)])
    y0, gx0, gw0 = fp8_grouped_grads(recipe, x, w, gy, offsets_E)

    def p2(*shape, seed):
        return torch.exp2(torch.randint(-8, 9, shape, generator=torch.Generator().manual_seed(seed)).float())

    r, c = p2(R, seed=1), p2(E, 1, N // block, seed=2).repeat_interleave(block, -1)
    y, _, _ = fp8_grouped_grads(recipe, x * r[:, None], w * c, gy, offsets_E)
    assert torch.equal(y[:used], (y0 * r[:, None])[:used] * c[expert_R[:used], 0])
    r, c = p2(R, seed=3), p2(E, K // block, 1, seed=4).repeat_interleave(block, 1)
    _, gx, _ = fp8_grouped_grads(recipe, x, w * c, gy * r[:, None], offsets_E)
    assert torch.equal(gx[:used], (gx0 * r[:, None])[:used] * c[expert_R[:used], :, 0])
    cx, cg = p2(E + 1, K, seed=5), p2(E + 1, N, seed=6)
    _, _, gw = fp8_grouped_grads(recipe, x * cx[expert_R], w, gy * cg[expert_R], offsets_E)
    assert torch.equal(gw, gw0 * cx[:E, :, None] * cg[:E, None, :])


# ---------------------------------------------------------------- selective precision


ALIGNED = {"model.dim": 128, "model.n_heads": 4, "model.ffn_hidden": 128, "moe.expert_hidden": 128,
           "moe.num_experts": 4, "moe.top_k": 2, "train.seq_len": 32, "train.micro_batch_size": 4,
           "model.n_layers": 3}
MODELS = {"tiny-qwen3": {**ALIGNED, "model.head_dim": 32, "model.n_kv_heads": 4},
          "tiny-deepseek": {**ALIGNED, "model.q_lora_rank": 128, "model.kv_lora_rank": 128, "moe.num_groups": 2,
                            "moe.group_top_k": 1, "moe.group_score_top_k": 1}}


def bf16_and_fp8_models(preset, recipe, extra):
    cfg = load_config(preset, {**MODELS[preset], **extra, "precision.fp8": recipe})
    ref = build_model(cfg, 256)
    ref.init_weights(0)
    ref = ref.to(torch.bfloat16)
    fp8 = copy.deepcopy(ref)
    converted = apply_fp8(fp8, cfg.precision, "cpu")
    return ref, fp8, converted


def block_outputs(model, i, x_BSD):
    cos, sin = model.rope(x_BSD.shape[1], "cpu")
    with torch.no_grad():
        return model.layers[i](x_BSD, cos, sin, None)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("preset", list(MODELS))
def test_excluded_blocks_run_in_bf16_bit_for_bit(preset, recipe):
    """A block kept in high precision by fp8_exclude (the block, or everything inside it) or by
    fp8_bf16_first/last_layers computes what the bf16 model's block computes, bit for bit (its
    MoE layer keeps its padding too); a converted block does not."""
    x = torch.randn(2, 32, 128, generator=torch.Generator().manual_seed(0)).bfloat16()
    for extra, kept in [({"precision.fp8_exclude": '["layers.0.*"]'}, [0]),
                        ({"precision.fp8_exclude": '["layers.2"]'}, [2]),
                        ({"precision.fp8_bf16_first_layers": 1, "precision.fp8_bf16_last_layers": 1}, [0, 2])]:
        ref, fp8, converted = bf16_and_fp8_models(preset, recipe, extra)
        assert converted and not any(n.startswith(tuple(f"layers.{i}." for i in kept)) for n in converted)
        for i in range(3):
            same = torch.equal(block_outputs(ref, i, x), block_outputs(fp8, i, x))
            assert same == (i in kept), (extra, i)


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_excluded_experts_and_the_high_precision_modules_equal_bf16(recipe):
    """With fp8_exclude=['*.experts'] the routed experts of a converted block stay the bf16
    model's (same output, bit for bit, on the same routed rows) while its attention is FP8; the
    router, embeddings, output head and norms of every block are never converted."""
    ref, fp8, converted = bf16_and_fp8_models("tiny-qwen3", recipe, {"precision.fp8_exclude": '["*.experts"]'})
    assert "layers.1.attn.wq" in converted and not any("experts" in n for n in converted)
    g = torch.Generator().manual_seed(1)
    x_RD = torch.randn(48, 128, generator=g).bfloat16()
    rows_E, probs_R = torch.tensor([16, 0, 20, 12]), torch.rand(48, generator=g)
    x_BSD = torch.randn(2, 32, 128, generator=g).bfloat16()
    with torch.no_grad():
        for i in range(3):
            a, b = ref.layers[i], fp8.layers[i]
            assert torch.equal(a.ffn.experts(x_RD, rows_E, probs_R), b.ffn.experts(x_RD, rows_E, probs_R))
            assert torch.equal(a.ffn.router(x_RD).probs_TK, b.ffn.router(x_RD).probs_TK)
            assert torch.equal(a.attn_norm(x_BSD), b.attn_norm(x_BSD))
            assert a.ffn.dispatcher.layout.multiple == b.ffn.dispatcher.layout.multiple
        ids = torch.randint(0, 256, (2, 32), generator=g)
        assert torch.equal(ref.tok_embeddings(ids), fp8.tok_embeddings(ids))
        assert torch.equal(ref.output(x_BSD), fp8.output(x_BSD)) and type(fp8.output) is nn.Linear


# ---------------------------------------------------------------- the MoE layer against a per-token loop


def fake_quant32(x, tile, fmt=E4M3):
    """ref_quantize dequantized in fp32 (the emulation computes in fp32 on the CPU)."""
    q, s = ref_quantize(x, tile, fmt)
    rows, cols = x.shape
    tr, tc = tile[0] or rows, tile[1] or cols
    return (q * s.repeat_interleave(tr, 0).repeat_interleave(tc, 1)).float()


@pytest.mark.parametrize("extra", [{}, {"moe.capacity_factor": 1.0}, {"moe.pad_multiple": 8},
                                   {"moe.memory_efficient_permute": False}],
                         ids=["dropless", "capacity", "pad8", "probs-after"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_moe_layer_equals_a_per_token_loop(recipe, extra):
    """The FP8 MoE layer (routing, per-expert padding to the FP8 alignment, grouped FP8 GEMMs,
    combine) equals a loop over each token's kept experts that quantizes the token's rows and the
    expert's weights by the recipe's tiles (tensorwise's experts scale rowwise). A token's rows
    are quantized by themselves (rows, 1x128), so the padding and the other tokens change nothing."""
    cfg = load_config("tiny-qwen3", {**MODELS["tiny-qwen3"], **extra, "precision.fp8": recipe})
    model = build_model(cfg, 256)
    model.init_weights(0)
    apply_fp8(model, cfg.precision, "cpu")
    layer, act, wt = model.layers[0].ffn, (1, 0), (0, 1)
    if recipe == "blockwise":
        act, wt = (1, 128), (128, 128)
    assert layer.dispatcher.layout.multiple == (128 if recipe == "blockwise" else 16)
    x_TD = torch.randn(32, 128, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y_TD = layer(x_TD[None])[0]
        routing = layer.router(x_TD)
        keep_TK = layer.capacity(routing.idx_TK, routing.probs_TK, None).view(32, 2)
        ex = layer.experts
        w1q, w3q, w2q = ([fake_quant32(w[e], wt) for e in range(4)] for w in (ex.w1_EDF, ex.w3_EDF, ex.w2_EFD))
        ref_TD = torch.zeros(32, 128)
        for t in range(32):
            for k in range(2):
                if not keep_TK[t, k]:
                    continue
                e, p = routing.idx_TK[t, k].item(), routing.probs_TK[t, k]
                xq = fake_quant32(x_TD[t:t + 1], act)
                h = F.silu(xq @ w1q[e]) * (xq @ w3q[e]) * p
                ref_TD[t] += (fake_quant32(h, act) @ w2q[e])[0]
    err_T = (y_TD - ref_TD).abs().amax(1) / ref_TD.abs().amax(1).clamp_min(1e-30)
    # fp32 against the reference's fp64 quantization: an FP8 rounding of h may flip (one token).
    assert (err_T < 1e-4).float().mean() >= 0.9, err_T
    assert err_T.max() < 0.05


# ---------------------------------------------------------------- option validation


@pytest.mark.parametrize("overrides,message", [
    ({"precision.fp8_exclude": "layers.0.*"}, "precision.fp8_exclude='layers.0.*' is not a list"),
    ({"precision.fp8_exclude": "[1]"}, "precision.fp8_exclude=[1] is not a list of str"),
    ({"precision.fp8_exclude": '["layers.0.*", " "]'}, "precision.fp8_exclude=['layers.0.*', ' '] has an empty pattern"),
    ({"precision.fp8_bf16_first_layers": "1.5"}, "precision.fp8_bf16_first_layers='1.5' is not a valid int"),
    ({"precision.fp8_saved_activations": "maybe"}, "precision.fp8_saved_activations='maybe' is not a valid bool"),
    ({"precision.fp8_weight_cache": "true"}, "precision.fp8_weight_cache=true caches FP8 weights: it needs precision.fp8"),
    ({"precision.fp8": "Rowwise"}, "precision.fp8='Rowwise' is not one of off, tensorwise, rowwise, blockwise"),
])
def test_bad_fp8_options_are_one_line_errors_naming_the_option(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config("tiny-qwen3", overrides)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize("pattern", ['["layers.3.*"]', '["layers.0.attn.wq.weight"]', '["*.expert"]'])
def test_an_exclude_pattern_matching_no_module_is_one_line(pattern):
    """A pattern naming a layer the model lacks, a parameter or a misspelt module is refused."""
    cfg = load_config("tiny-qwen3", {**MODELS["tiny-qwen3"], "precision.fp8": "rowwise",
                                     "precision.fp8_exclude": pattern})
    model = build_model(cfg, 256)
    with pytest.raises(ConfigError, match=r"^precision.fp8_exclude: pattern .* matches no module name") as err:
        apply_fp8(model, cfg.precision, "cpu")
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- tensor parallelism (gloo)


def _column_wise_fp8_linear_on_rank(rank: int, out) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from moefold.fp8.linear import ColumnShards, shard_fp8_linears

    dist.init_process_group("gloo")
    x_MK, w_NK, gy_MN = column_wise_case()
    linear = Fp8Linear.from_linear(nn.Linear(128, 256, bias=False), EmulatedFp8Gemm(), linear_scaling("rowwise"))
    with torch.no_grad():
        linear.weight.copy_(w_NK)
    parallelize_module(linear, init_device_mesh("cpu", (2,)), ColwiseParallel())
    shard_fp8_linears(linear)
    assert isinstance(linear.shards, ColumnShards)
    y_Mn = linear(x_MK)
    y_Mn.backward(gy_MN[:, rank * 128:(rank + 1) * 128])
    torch.save({"y": y_Mn.detach(), "grad_w": linear.weight.grad.to_local()}, f"{out}.{rank}")


def column_wise_case():
    g = torch.Generator().manual_seed(0)
    return torch.randn(40, 128, generator=g), torch.randn(256, 128, generator=g), torch.randn(40, 256, generator=g)


def test_a_column_wise_rowwise_fp8_linear_under_tp_equals_one_process(tmp_path):
    """Under tp=2 a column-wise FP8 linear (ColumnShards) multiplies the whole, replicated input by
    its rank's output features: rowwise scales (per token over K, per output feature over K, and
    for the weight gradient per output feature and per input feature over the tokens) then lie
    whole on each rank, so its output shard and weight-gradient shard equal one process's bit for
    bit (grad_input, whose rows span one rank's features, and row-wise linears only come close)."""
    from ranks import run_ranks

    out = tmp_path / "shard"
    run_ranks(2, _column_wise_fp8_linear_on_rank, str(out))
    x_MK, w_NK, gy_MN = column_wise_case()
    y, _, grad_w = fp8_linear_grads("rowwise", x_MK, w_NK, gy_MN)
    for rank in range(2):
        got = torch.load(f"{out}.{rank}")
        features = slice(rank * 128, (rank + 1) * 128)
        assert torch.equal(got["y"], y[:, features])
        assert torch.equal(got["grad_w"], grad_w[features])


def _sequence_shard_fp8_linear_on_rank(rank: int, out) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    from moefold.fp8.linear import TokenShards, shard_fp8_linears

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    x_BSK, w_NK, gy_BSN = sequence_shard_case()
    linear = Fp8Linear.from_linear(nn.Linear(128, 256, bias=False), EmulatedFp8Gemm(), linear_scaling("rowwise"))
    with torch.no_grad():
        linear.weight.copy_(w_NK)
    parallelize_module(linear, mesh, SequenceParallel())  # as MLA's down-projections under SP
    shard_fp8_linears(linear)
    assert isinstance(linear.shards, TokenShards)
    tokens = slice(rank * 8, (rank + 1) * 8)
    x_local = x_BSK[:, tokens].clone().requires_grad_()
    y = linear(DTensor.from_local(x_local, mesh, [Shard(1)]))
    assert y.placements == (Shard(1),)
    y.backward(DTensor.from_local(gy_BSN[:, tokens], mesh, [Shard(1)]))
    torch.save({"y": y.to_local().detach(), "grad_x": x_local.grad, "grad_w": linear.weight.grad.full_tensor()},
               f"{out}.{rank}")


def sequence_shard_case():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 16, 128, generator=g), torch.randn(256, 128, generator=g), torch.randn(2, 16, 256, generator=g)


def test_a_replicated_fp8_linear_on_sequence_shards_equals_one_process(tmp_path):
    """A replicated-weight FP8 linear reading this rank's sequence shard (TokenShards: MLA's
    down-projections under sequence parallelism), rowwise: per-token and per-feature scales over
    K and N lie whole on each rank, so the output shard and grad_input equal one process's bit for
    bit; the weight gradient is the ranks' sum (Partial), each scaled over its own tokens: within
    FP8 noise of one process's (3.2% measured; a mean instead of a sum would be off by 50%)."""
    from ranks import run_ranks

    out = tmp_path / "shard"
    run_ranks(2, _sequence_shard_fp8_linear_on_rank, str(out))
    x_BSK, w_NK, gy_BSN = sequence_shard_case()
    y, grad_x, grad_w = fp8_linear_grads("rowwise", x_BSK, w_NK, gy_BSN)
    for rank in range(2):
        got = torch.load(f"{out}.{rank}")
        tokens = slice(rank * 8, (rank + 1) * 8)
        assert torch.equal(got["y"], y[:, tokens]) and torch.equal(got["grad_x"], grad_x[:, tokens])
        assert (got["grad_w"] - grad_w).norm() / grad_w.norm() < 0.1
