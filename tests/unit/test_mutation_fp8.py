"""Tests that kill mutants of the FP8 CPU path (moefold.fp8, optim/blocks.py) that the other FP8
tests let through: each compares with an fp64 reference written here from the recipes' definitions,
with the formats' constants written out (e4m3: max 448; e5m2: max 57344), sharing nothing with
recipes.py but the torch FP8 dtypes.

M tokens, K input features, N output features, E experts, R routed rows.
"""

import pytest
import torch

from moefold.fp8.recipes import E4M3, E5M2, Operand, quantize

# The formats by their definition (OCP FP8: e4m3fn's largest finite value 1.75 · 2^8, e5m2's 1.75 · 2^15).
FORMATS = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}
FMT = {"e4m3": E4M3, "e5m2": E5M2}
# Tile (rows, cols) of each kind over the last two dims; 0 = the whole dim.
TILES = {"tensor": (0, 0), "row": (1, 0), "col": (0, 1), "1x128": (1, 128), "128x1": (128, 1),
         "128x128": (128, 128)}


def ref_quantize(x, tile, fmt_name):
    """(FP8 values as fp64, per-tile scales in fp64): scale = amax / fp8_max (1 for an all-zero
    tile), x / scale clamped to ±fp8_max and cast, one tile at a time."""
    dtype, fp8_max = FORMATS[fmt_name]
    x64 = x.double()
    rows, cols = x.shape
    tr, tc = tile[0] or rows, tile[1] or cols
    q = torch.empty_like(x64)
    scale = torch.empty(rows // tr, cols // tc, dtype=torch.float64)
    for i in range(0, rows, tr):
        for j in range(0, cols, tc):
            t = x64[i:i + tr, j:j + tc]
            amax = t.abs().max().item()
            s = amax / fp8_max if amax > 0 else 1.0
            scale[i // tr, j // tc] = s
            q[i:i + tr, j:j + tc] = (t / s).clamp(-fp8_max, fp8_max).to(dtype).double()
    return q, scale


def ref_fake_quant(x, tile, fmt_name):
    """ref_quantize dequantized, in fp64."""
    q, s = ref_quantize(x, tile, fmt_name)
    rows, cols = x.shape
    tr, tc = tile[0] or rows, tile[1] or cols
    return q * s.repeat_interleave(tr, 0).repeat_interleave(tc, 1)


def randn(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- recipes.py: the formats


@pytest.mark.parametrize("fmt_name", list(FORMATS))
@pytest.mark.parametrize("kind", list(TILES))
def test_each_tiles_amax_lands_on_the_formats_written_out_max(kind, fmt_name):
    """Every tile's scale is amax / 448 (e4m3) or amax / 57344 (e5m2), so each tile's largest
    value becomes exactly that maximum: a format whose max were off (49152 for e5m2) would still
    agree with references that read the max from the format object."""
    x = randn((256, 256), 0) * torch.exp2(torch.randint(-8, 9, (256, 1), generator=torch.Generator().manual_seed(1)))
    x_fp8, scale = quantize(x, Operand(kind, FMT[fmt_name]))
    q_ref, scale_ref = ref_quantize(x, TILES[kind], fmt_name)
    assert x_fp8.dtype == FORMATS[fmt_name][0]
    assert FMT[fmt_name].max == FORMATS[fmt_name][1] == torch.finfo(FORMATS[fmt_name][0]).max
    torch.testing.assert_close(scale.double(), scale_ref, rtol=2 ** -22, atol=0)
    assert x_fp8.double().abs().max().item() == FORMATS[fmt_name][1]
    assert (x_fp8.double() != q_ref).double().mean() < 1e-3  # ties within fp32's rounding of x / scale



# ---------------------------------------------------------------- linear.py / saved.py in bf16


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_fp8_saved_input_leaves_grad_input_bit_for_bit_in_bf16(recipe):
    """grad_input = grad_y @ W never reads x, so keeping x in FP8 (precision.fp8_saved_activations)
    leaves it bit for bit in the bf16 compute dtype too (the other tests run fp32), and the
    weight gradient stays in bf16, within FP8 noise of the plain run's: the saved x is dequantized
    into the compute dtype, not fp32 (which would run the backward's GEMMs in fp32)."""
    from torch import nn

    from moefold.fp8.gemm import EmulatedFp8Gemm, linear_scaling
    from moefold.fp8.linear import Fp8Linear
    from moefold.fp8.saved import SaveFp8Input, SaveInput

    M, K, N = 64, 256, 128
    scaling = linear_scaling(recipe)
    base = nn.Linear(K, N, bias=False).bfloat16()
    x, gy = randn((M, K), 0).bfloat16(), randn((M, N), 1).bfloat16()
    grads = []
    for saver in (SaveInput(), SaveFp8Input(scaling.forward.a)):
        lin = Fp8Linear.from_linear(base, EmulatedFp8Gemm(), scaling, saver)
        xr = x.clone().requires_grad_()
        base.weight.grad = None
        lin(xr).backward(gy)
        grads.append((xr.grad, base.weight.grad.clone()))
    (gx, gw), (gx8, gw8) = grads
    assert gx8.dtype == gw8.dtype == torch.bfloat16
    assert torch.equal(gx8, gx)
    assert ((gw8.double() - gw.double()).norm() / gw.double().norm()).item() < 0.1


# ---------------------------------------------------------------- apply.py: selective precision

ALIGNED = {"model.dim": 128, "model.n_heads": 4, "model.ffn_hidden": 128, "moe.expert_hidden": 128, "moe.num_experts": 4, "moe.top_k": 2,
           "train.seq_len": 32, "train.micro_batch_size": 4, "model.n_layers": 2}


def fp8_model(recipe, extra=(), preset="tiny-qwen3", **apply_kwargs):
    from moefold.config import load_config
    from moefold.fp8.apply import apply_fp8
    from moefold.models.transformer import build_model

    heads = {"model.head_dim": 32, "model.n_kv_heads": 4} if preset == "tiny-qwen3" else {}
    cfg = load_config(preset, {**ALIGNED, **heads, **dict(extra), "precision.fp8": recipe})
    model = build_model(cfg, 256)
    return model, apply_fp8(model, cfg.precision, "cpu", **apply_kwargs)


@pytest.mark.parametrize("recipe,pad,want", [("rowwise", 8, 16), ("rowwise", 32, 32), ("rowwise", 128, 128),
                                             ("blockwise", 32, 128), ("blockwise", 128, 128)])
def test_fp8_raises_the_expert_padding_to_its_tile_and_never_lowers_it(recipe, pad, want):
    """Each expert's rows are padded to a multiple of the FP8 tile (16 rowwise, 128 blockwise)
    or of moe.pad_multiple, whichever is larger: a pad_multiple above the tile is the user's and
    stays (docs: 'raised here, never lowered')."""
    model, converted = fp8_model(recipe, {"moe.pad_multiple": pad})
    assert "layers.1.ffn.experts" in converted
    assert [layer.ffn.dispatcher.layout.multiple for layer in model.layers] == [want, want]


def saved_kinds(block, names):
    """'fp8' or 'input' (what each linear keeps for backward), by name under `block`."""
    return {n: block.get_submodule(n).saver.name for n in names}


@pytest.mark.parametrize("shared_inputs", [True, False])
def test_which_linears_keep_their_input_in_fp8(shared_inputs):
    """precision.fp8_saved_activations keeps a linear's input in FP8 only where that frees a copy:
    never wo (its input is the attention core's output, kept anyway); q/k/v and gate/up only when
    each casts its own input (shared_inputs=False: fp32 parameters under autocast), since FP8
    copies of one shared input would keep more; an MTP block reads its projection's output in the
    compute dtype, so its siblings share their input either way."""
    qwen, _ = fp8_model("rowwise", {"precision.fp8_saved_activations": True}, shared_inputs=shared_inputs)
    siblings = "fp8" if not shared_inputs else "input"
    assert saved_kinds(qwen.layers[1].attn, ["wq", "wk", "wv", "wo"]) == {
        "wq": siblings, "wk": siblings, "wv": siblings, "wo": "input"}
    deepseek_dims = {"model.q_lora_rank": 128, "model.kv_lora_rank": 128, "model.qk_rope_head_dim": 16,
                     "moe.num_groups": 2, "moe.group_top_k": 1, "moe.group_score_top_k": 1}
    deepseek, converted = fp8_model("rowwise", {"precision.fp8_saved_activations": True, **deepseek_dims},
                                    preset="tiny-deepseek", shared_inputs=shared_inputs)
    mtp_block = deepseek.mtp.layers[0].block
    assert "mtp.layers.0.block.attn.wq_a" in converted
    assert saved_kinds(deepseek.layers[1].attn, ["wq_a", "wkv_a", "wo"]) == {"wq_a": siblings, "wkv_a": siblings,
                                                                             "wo": "input"}
    assert saved_kinds(mtp_block.attn, ["wq_a", "wkv_a", "wo"]) == {"wq_a": "input", "wkv_a": "input", "wo": "input"}


def test_tensorwise_experts_keep_their_input_per_row():
    """Under tensorwise the routed experts run rowwise (no grouped form of one tensor scale), so
    what they keep in FP8 for the backward has the grouped forward's tiles, one scale per row:
    one tensor scale would tie every expert's rows to the largest (a row 2^-12 of the others would
    round to zeros); the block linears keep theirs per tensor, as their forward quantizes it."""
    model, _ = fp8_model("tensorwise", {"precision.fp8_saved_activations": True}, shared_inputs=False)
    x = randn((64, 128), 5) * torch.exp2(torch.randint(-12, 1, (64, 1), generator=torch.Generator().manual_seed(6)))
    for module, tile in ((model.layers[1].ffn.experts, (1, 0)), (model.layers[1].attn.wq, (0, 0))):
        kept = module.saver.unpack(module.saver.pack(x), torch.float32)
        ref = ref_fake_quant(x, tile, "e4m3")
        err = (kept.double() - ref).abs()
        assert (err <= ref.abs() * 2.0 ** -3).all(), tile  # ties of fp32's x / scale: one e4m3 step


# ---------------------------------------------------------------- weight_cache.py under autocast


def test_the_weight_cache_under_bf16_autocast_equals_quantizing_per_call():
    """fp32 expert weights under bf16 autocast (a GPU run's compute): the experts cast their
    weights to bf16 and quantize those, so the cache must quantize the bf16 cast too — quantized
    from the fp32 values its FP8 operands (and their dtype) differ from the per-call ones."""
    from moefold.fp8.grouped import EmulatedFp8GroupedGemm, grouped_scaling
    from moefold.fp8.weight_cache import CachedWeights, refresh_weight_caches
    from moefold.moe.experts import Fp8GroupedExperts

    def experts(cache):
        torch.manual_seed(0)
        e = Fp8GroupedExperts(4, 64, 32, None, EmulatedFp8GroupedGemm(), grouped_scaling("rowwise"),
                              weight_cache=CachedWeights(torch.bfloat16) if cache else None)
        with torch.no_grad():
            for p in e.parameters():
                p.copy_(torch.randn(p.shape) * 0.05 * (1 + 2 ** -12))  # not bf16 values
        refresh_weight_caches(e)
        return e

    rows_E = torch.tensor([16, 0, 32, 16])
    x, probs = randn((64, 64), 7), torch.rand(64, generator=torch.Generator().manual_seed(8))
    outs = []
    for cache in (False, True):
        e = experts(cache)
        xr = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = e(xr, rows_E, probs)
        y.float().square().sum().backward()
        outs.append((y.detach(), xr.grad, *(p.grad for p in e.parameters())))
    for per_call, cached in zip(*outs):
        assert per_call.dtype == cached.dtype and torch.equal(per_call, cached)


# The recipes' table (recipes.py): (activation a_MK tile, weight b_KN tile).
RECIPE_TILES = {"tensorwise": ((0, 0), (0, 0)), "rowwise": ((1, 0), (0, 1)), "blockwise": ((1, 128), (128, 128))}


@pytest.mark.parametrize("fmt_name", list(FORMATS))
@pytest.mark.parametrize("recipe", list(RECIPE_TILES))
def test_make_recipe_quantizes_and_multiplies_by_its_table(recipe, fmt_name):
    """make_recipe's recipes (the public emulation, emulated_mm) scale a_MK per its tile and b_KN
    per its own: rowwise's weight per output column ([1, N]: a row of b would run along the
    contraction), blockwise's in 128x128 blocks; emulated_mm is the fp64 product of those."""
    from moefold.fp8.recipes import emulated_mm, make_recipe

    M, K, N = 128, 256, 384
    g = torch.Generator().manual_seed(11)
    a = randn((M, K), 12) * torch.exp2(torch.randint(-8, 9, (M, 1), generator=g))
    b = randn((K, N), 13) * torch.exp2(torch.randint(-8, 9, (1, N), generator=g))
    rec = make_recipe(recipe, fmt_name)
    a_tile, b_tile = RECIPE_TILES[recipe]
    for x, operand, tile in ((a, "activation", a_tile), (b, "weight", b_tile)):
        _, scale = rec.quantize(x, operand)
        _, scale_ref = ref_quantize(x, tile, fmt_name)
        assert scale.shape == scale_ref.shape, operand
        torch.testing.assert_close(scale.double(), scale_ref, rtol=2 ** -22, atol=0)
    want = ref_fake_quant(a, a_tile, fmt_name) @ ref_fake_quant(b, b_tile, fmt_name)
    got = emulated_mm(a, b, rec, dtype=torch.float32).double()
    # ties of fp32's x / scale may round one element a step the other way: a few in 10^3
    assert ((got - want).norm() / want.norm()).item() < 2e-3


# ---------------------------------------------------------------- optim/blocks.py: fp8 moments


def ref_moment_blocks(x_RC, block=128):
    """(e4m3 values as fp64, scales [R, ceil(C / 128)] in fp64) of rows cut into 128-element
    blocks (the last one short): scale = amax / 448, the smallest normal fp32 where that is 0."""
    R, C = x_RC.shape
    q = torch.empty(R, C, dtype=torch.float64)
    scale = torch.empty(R, -(-C // block), dtype=torch.float64)
    for r in range(R):
        for j in range(0, C, block):
            t = x_RC[r, j:j + block].double()
            s = max(t.abs().max().item() / 448.0, torch.finfo(torch.float32).tiny)
            scale[r, j // block] = s
            q[r, j:j + block] = (t / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).double()
    return q, scale


def test_fp8_moments_take_each_blocks_amax_to_448():
    """PrecisionAwareAdamW's moment blocks (128 along each row, a short last one) are scaled by
    amax / 448: each block's largest value is stored as 448 itself, not a smaller maximum (a
    scale of amax / 224 still dequantizes within the round trip's tolerance, one binade lower)."""
    from moefold.optim.blocks import FP8, dequantize_fp8, quantize_fp8, quantize_fp8_many, row_blocks

    x = randn((6, 300), 2) * torch.exp2(torch.randint(-20, 21, (6, 1), generator=torch.Generator().manual_seed(3)))
    x[1] = 0.0  # an all-zero row: its scales are the smallest normal fp32, its values 0
    x[4] *= 1e-35 / x[4].abs().max()  # v of gradients ~3e-18: scales ~2e-38, above fp32's smallest normal
    q_ref, scale_ref = ref_moment_blocks(x)
    for q, scale in (quantize_fp8(x, row_blocks(x)), [t[0] for t in quantize_fp8_many([x], [row_blocks(x)])]):
        assert q.dtype == FP8 and scale.shape == (6, 3)
        torch.testing.assert_close(scale.double(), scale_ref, rtol=2 ** -22, atol=0)
        assert (q.double() != q_ref).double().mean() < 1e-3
        nonzero = torch.arange(6) != 1
        block_max = torch.nn.functional.pad(q.double().abs(), (0, 84)).view(6, 3, 128).amax(dim=2)
        assert (block_max[nonzero] == 448.0).all()
        back = dequantize_fp8(q, scale, row_blocks(x)).double()
        per_elem = scale_ref.repeat_interleave(128, dim=1)[:, :300]
        assert ((back - x.double()).abs() <= x.double().abs() * 2.0 ** -4 + per_elem * 2.0 ** -10).all()


def test_the_floor_keeps_small_sqrt_v_above_zero():
    """sqrt(v) is stored with a floor of e4m3's smallest subnormal (2^-9 of its block's scale):
    an element below half of it, which would round to 0 and make its update m / eps, is stored as
    2^-9 · scale; the others as without the floor."""
    from moefold.optim.blocks import dequantize_fp8, quantize_fp8, quantize_fp8_many, row_blocks

    x = randn((4, 256), 9).abs()
    x[:, 5] = 2.0 ** -11  # a quarter of e4m3's smallest subnormal, 2^-9, in blocks whose amax is 448 (scale 1)
    x[:, 0] = 448.0
    q_ref, scale_ref = ref_moment_blocks(x)
    q_ref = q_ref.clamp_min(2.0 ** -9)
    b = row_blocks(x)
    for q, scale in (quantize_fp8(x, b, floor=2.0 ** -9),
                     [t[0] for t in quantize_fp8_many([x], [b], floor=2.0 ** -9)]):
        assert (q.double()[:, 5] == 2.0 ** -9).all()
        assert (q.double() != q_ref).double().mean() < 1e-3
        assert (dequantize_fp8(q, scale, b) > 0).all()
