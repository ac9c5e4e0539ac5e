"""PrecisionAwareAdamW against torch.optim.AdamW (the reference), on a tiny MoE model."""

import functools
import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import TINY_OVERRIDES
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from moefold.config import load_config
from moefold.models.transformer import build_model
from moefold.optim import precision
from moefold.optim.adamw import build_optimizer, param_groups, round_gradients
from moefold.optim.blocks import (
    BLOCK,
    FP8_MIN_SUBNORMAL,
    RowBlocks,
    dequantize_fp8,
    dequantize_fp8_many,
    quantize_fp8,
    quantize_fp8_many,
    row_blocks,
)
from moefold.optim.precision import FP8, PrecisionAwareAdamW, join_fp32
from moefold.train.loss import cross_entropy_loss

VOCAB, STEPS = 64, 200
HP = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8}


def tiny_model(dtype=torch.float32):
    cfg = load_config("tiny", {k: v for k, v in TINY_OVERRIDES.items() if k.startswith(("model.", "moe."))})
    model = build_model(cfg, VOCAB)
    model.init_weights(seed=0)
    return model.to(dtype)


def batches(n: int):
    """A fixed stream of learnable sequences: x[t+1] = 3·x[t] + 1 (mod V), with 10% noise."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(n):
        ids_BS = torch.empty(4, 33, dtype=torch.long)
        ids_BS[:, 0] = torch.randint(0, VOCAB, (4,), generator=gen)
        for t in range(32):
            ids_BS[:, t + 1] = (3 * ids_BS[:, t] + 1) % VOCAB
        noise_BS = torch.rand(4, 33, generator=gen) < 0.1
        ids_BS[noise_BS] = torch.randint(0, VOCAB, (int(noise_BS.sum()),), generator=gen)
        yield ids_BS[:, :-1], ids_BS[:, 1:]


def train(model, opt, steps: int = STEPS, start: int = 0) -> list[float]:
    losses = []
    for i, (ids_BS, labels_BS) in enumerate(batches(start + steps)):
        if i < start:
            continue
        loss = cross_entropy_loss(model(ids_BS), labels_BS)
        loss.backward()
        opt.step()
        model.on_optimizer_step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@functools.cache
def final_loss(**options) -> float:
    """Mean train loss over the last 10 of STEPS steps."""
    model = tiny_model()
    opt = PrecisionAwareAdamW(param_groups(model, 0.1), **HP, **options)
    return sum(train(model, opt)[-10:]) / 10


def test_fp32_matches_torch_adamw_step_by_step():
    model, ref_model = tiny_model(), tiny_model()
    opt = PrecisionAwareAdamW(param_groups(model, 0.1), **HP)
    ref = torch.optim.AdamW(param_groups(ref_model, 0.1), **HP, foreach=False)
    for i, (ids_BS, labels_BS) in enumerate(batches(50)):
        for m, o in ((model, opt), (ref_model, ref)):
            cross_entropy_loss(m(ids_BS), labels_BS).backward()
            o.step()
            m.on_optimizer_step()
            o.zero_grad(set_to_none=True)
        for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
            assert torch.equal(p, q), f"step {i}"


# Final loss against fp32's, measured over init seeds 0-5: bf16 moments -0.2 to +0.5%, fp8 moments
# -1.4 to +0.8%; a plain bf16 master, where updates under half a bf16 ulp vanish, -0.4 to +2.6%.
@pytest.mark.parametrize("options, bound", [({"exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"}, 0.02),
                                            ({"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8"}, 0.02),
                                            ({"master": "bf16"}, 0.04), ({"master": "bf16+remainder"}, 0.02)],
                         ids=["bf16-moments", "fp8-moments", "bf16-master", "bf16+remainder"])
def test_low_precision_final_loss_close_to_fp32(options, bound):
    reference, loss = final_loss(), final_loss(**options)
    print(f"{options}: final loss {loss:.4f} vs fp32 {reference:.4f} ({loss / reference - 1:+.2%})")
    assert reference < 3.0  # it learned something (uniform is ln 64 = 4.16)
    assert abs(loss / reference - 1) < bound


def test_remainder_master_is_the_fp32_adamw_master_bit_for_bit():
    """Given the same gradients, bf16 + remainder rebuilds torch AdamW's fp32 parameter exactly;
    the bf16 parameter is that value rounded to nearest."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=gen)
    ref_p, p = torch.nn.Parameter(x.clone()), torch.nn.Parameter(x.clone())
    ref = torch.optim.AdamW([ref_p], **HP, weight_decay=0.1, foreach=False)
    opt = PrecisionAwareAdamW([p], **HP, weight_decay=0.1, master="bf16+remainder")
    assert p.dtype == torch.bfloat16
    for _ in range(100):
        g = torch.randn(1000, generator=gen).bfloat16()  # representable in both runs
        ref_p.grad, p.grad = g.float(), g
        ref.step()
        opt.step()
        master = join_fp32(p.detach(), opt.state[p]["master_remainder"])
        assert torch.equal(master.view(torch.int32), ref_p.detach().view(torch.int32))
        # round to nearest; ties go away from zero (TransformerEngine's layout), not to even
        tie = (master.view(torch.int32) & 0xFFFF) == 0x8000
        assert torch.equal(p.detach()[~tie], ref_p.detach().bfloat16()[~tie])


OPTIONS_ALL = {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "bf16", "master": "bf16+remainder"}


def test_state_dict_round_trip_keeps_dtypes_and_continues_bit_identically(tmp_path):
    model = tiny_model()
    opt = PrecisionAwareAdamW(param_groups(model, 0.1), **HP, **OPTIONS_ALL)
    train(model, opt, steps=5)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path)
    expected = train(model, opt, steps=5, start=5)

    fresh = tiny_model()
    fresh_opt = PrecisionAwareAdamW(param_groups(fresh, 0.1), **HP, **OPTIONS_ALL)
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=tmp_path)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    dtypes = {k: v.dtype for s in fresh_opt.state.values() for k, v in s.items()}
    assert dtypes == {"step": torch.float32, "exp_avg": FP8, "exp_avg_scale": torch.float32,
                      "exp_avg_sq": torch.bfloat16, "master_remainder": torch.int16}
    assert train(fresh, fresh_opt, steps=5, start=5) == expected
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)
    for s, t in zip(opt.state.values(), fresh_opt.state.values(), strict=True):
        for key in s:
            assert s[key].dtype == t[key].dtype and torch.equal(s[key].float(), t[key].float()), key


def test_plain_load_state_dict_keeps_dtypes():
    model = tiny_model()
    opt = PrecisionAwareAdamW(model.parameters(), **HP, exp_avg_dtype="fp8", exp_avg_sq_dtype="fp8",
                              master="bf16+remainder")
    train(model, opt, steps=3)
    fresh = PrecisionAwareAdamW(tiny_model().parameters(), **HP, exp_avg_dtype="fp8",
                                exp_avg_sq_dtype="fp8", master="bf16+remainder")
    fresh.load_state_dict(opt.state_dict())
    for s, t in zip(opt.state.values(), fresh.state.values(), strict=True):
        for key in s:
            assert t[key].dtype == s[key].dtype and torch.equal(t[key].float(), s[key].float()), key


def test_bad_option_names_the_allowed_values():
    with pytest.raises(ValueError, match="exp_avg_dtype='fp16'; allowed: fp32, bf16, fp8"):
        PrecisionAwareAdamW([torch.nn.Parameter(torch.zeros(2))], exp_avg_dtype="fp16")


# ---------------------------------------------------------------------- foreach and fp8 blocks

FOREACH_OPTIONS = [{}, {"exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "fp8", "master": "bf16+remainder"},
                   {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "bf16", "master": "bf16"},
                   {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8"}]


@pytest.mark.parametrize("options, chunk", [*((o, None) for o in FOREACH_OPTIONS), (FOREACH_OPTIONS[1], 2000)],
                         ids=["fp32", "lean", "fp8-bf16-bf16master", "fp8", "lean-chunked"])
def test_foreach_is_bit_identical_to_the_per_parameter_loop(options, chunk, monkeypatch):
    if chunk:  # several foreach calls per group, some parameters alone
        monkeypatch.setattr(precision, "FOREACH_ELEMENTS", chunk)
    models = [tiny_model(), tiny_model()]
    opts = [PrecisionAwareAdamW(param_groups(m, 0.1), **HP, **options, foreach=f)
            for m, f in zip(models, (True, False))]
    for i, (ids_BS, labels_BS) in enumerate(batches(20)):
        for m, o in zip(models, opts):
            cross_entropy_loss(m(ids_BS), labels_BS).backward()
            o.step()
            m.on_optimizer_step()
            o.zero_grad(set_to_none=True)
        for p, q in zip(*(m.parameters() for m in models), strict=True):
            assert torch.equal(p, q), f"step {i}"
    for s, t in zip(*(o.state.values() for o in opts), strict=True):
        for key in s:
            assert torch.equal(s[key].reshape(-1).view(torch.uint8), t[key].reshape(-1).view(torch.uint8)), key


def _blocks_of(shape, col0=0, global_cols=None):
    rows = math.prod(shape[:-1])
    return RowBlocks(rows, shape[-1], col0, math.ceil((global_cols or shape[-1]) / BLOCK))


def test_batched_fp8_quantisation_equals_one_tensor_at_a_time():
    """Shapes with short last blocks, rows shorter than a block, an empty shard, and local shards
    that start inside a block (col0 not a multiple of BLOCK: the scales cover the global row)."""
    gen = torch.Generator().manual_seed(0)
    cases = [((3, 300), 0, None), ((64,), 0, None), ((2, 5, 40), 0, None), ((0, 7), 0, None),
             ((4, 100), 150, 400), ((90,), 37, 200)]
    xs = [torch.randn(shape, generator=gen) * torch.rand(shape, generator=gen).exp2().pow(8)
          for shape, _, _ in cases]
    bs = [_blocks_of(shape, col0, cols) for shape, col0, cols in cases]
    for floor in (0.0, FP8_MIN_SUBNORMAL):
        inputs = [x.abs() for x in xs] if floor else xs  # the floor is for sqrt(v) >= 0
        qs, scales = quantize_fp8_many(inputs, bs, floor=floor)
        for x, b, q, scale in zip(inputs, bs, qs, scales, strict=True):
            q1, scale1 = quantize_fp8(x, b, floor=floor)
            assert q.shape == x.shape and q.dtype == FP8 and scale.shape == (b.rows, b.n_blocks)
            assert torch.equal(q.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(scale, scale1)
            back = dequantize_fp8(q, scale, b)
            assert torch.equal(back, dequantize_fp8_many([q], [scale], [b])[0])
            if x.numel():
                torch.testing.assert_close(back, x, rtol=2 ** -4, atol=scale.max().item() * 2 ** -9)


def test_fp8_blocks_run_along_rows_of_the_last_dimension():
    """A row of small values beside a row of large ones keeps its own scale: blocks never cross
    rows (one flattened 128-element block would round the small row to zero)."""
    x = torch.cat([torch.full((1, 64), 1e-6), torch.full((1, 64), 1e3)])
    b = row_blocks(x)
    q, scale = quantize_fp8(x, b)
    assert scale.shape == (2, 1)
    torch.testing.assert_close(dequantize_fp8(q, scale, b), x, rtol=2 ** -4, atol=0)


# ------------------------------------------------------------------------------ optim.grad_dtype


def test_bf16_gradients_train_within_2_percent_of_fp32():
    """optim.grad_dtype=bf16 in one process: every gradient rounded to bf16 before the step."""
    model = tiny_model()
    opt = torch.optim.AdamW(param_groups(model, 0.1), **HP, foreach=False)
    opt.register_step_pre_hook(round_gradients(torch.bfloat16))
    loss = sum(train(model, opt)[-10:]) / 10
    reference = final_loss()  # fp32 states: bit-identical to this AdamW without the hook
    print(f"bf16 gradients: final loss {loss:.4f} vs fp32 {reference:.4f} ({loss / reference - 1:+.2%})")
    assert loss != reference  # the rounding acted
    assert abs(loss / reference - 1) < 0.02


def test_grad_dtype_rounds_gradients_before_the_step():
    from moefold.config import OptimConfig, TrainConfig

    p = torch.nn.Parameter(torch.zeros(300))
    model = torch.nn.Module()
    model.w = p
    opt = build_optimizer(model, TrainConfig(), torch.device("cpu"), OptimConfig(grad_dtype="bf16"))
    grad = torch.randn(300, generator=torch.Generator().manual_seed(0))
    p.grad = grad.clone()
    opt.step()
    assert p.grad.dtype == torch.float32 and not torch.equal(p.grad, grad)
    assert torch.equal(p.grad, grad.bfloat16().float())


# ------------------------------------------------------------------------------ fused=True


@pytest.mark.skipif(precision.triton_available(), reason="Triton and a CUDA device are here")
def test_fused_without_triton_or_cuda_names_the_option():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match=r"fused=True needs Triton and a CUDA device .*use fused=False"):
        PrecisionAwareAdamW([p], master="bf16", fused=True)
    assert p.dtype == torch.float32  # refused before any parameter was recast


def test_fused_takes_every_moment_dtype(monkeypatch):
    monkeypatch.setattr(precision, "triton_available", lambda: True)
    for moments in ("fp32", "bf16", "fp8"):
        opt = PrecisionAwareAdamW([torch.nn.Parameter(torch.zeros(2))], exp_avg_sq_dtype=moments, fused=True)
        assert opt.defaults["fused"], moments


def test_build_optimizer_fuses_only_on_cuda_with_triton(monkeypatch):
    """The strategy is chosen at build: the kernel on a CUDA device where Triton runs (any
    moments); the foreach path otherwise."""
    from moefold.config import OptimConfig, TrainConfig
    from moefold.optim import adamw

    monkeypatch.setattr(adamw, "triton_available", lambda: True)
    monkeypatch.setattr(precision, "triton_available", lambda: True)

    def fused(device, **options):
        model = torch.nn.Linear(4, 4)
        opt = build_optimizer(model, TrainConfig(), torch.device(device), OptimConfig(**options))
        return opt.defaults["fused"]

    assert fused("cuda", exp_avg_dtype="bf16", master_dtype="bf16+remainder")
    assert not fused("cpu", exp_avg_dtype="bf16")
    assert fused("cuda", exp_avg_dtype="fp8", exp_avg_sq_dtype="fp8")
    monkeypatch.setattr(adamw, "triton_available", lambda: False)
    assert not fused("cuda", exp_avg_dtype="bf16")


def test_fused_choice_survives_loading_a_state_dict(monkeypatch):
    """A checkpoint's `fused` is the saver's choice; the loading process keeps its own."""
    monkeypatch.setattr(precision, "triton_available", lambda: True)
    saver = PrecisionAwareAdamW(tiny_model().parameters(), **HP, exp_avg_dtype="bf16", fused=True)
    loader = PrecisionAwareAdamW(tiny_model().parameters(), **HP, exp_avg_dtype="bf16")
    loader.load_state_dict(saver.state_dict())
    assert [g["fused"] for g in loader.param_groups] == [False]
    saver.load_state_dict(loader.state_dict())
    assert [g["fused"] for g in saver.param_groups] == [True]
