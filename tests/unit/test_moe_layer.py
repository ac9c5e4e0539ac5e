"""The whole MoE layer against the per-token loop reference (tests/moe_reference.py) over
randomized configurations, plus the properties the reference cannot show."""

import dataclasses

import pytest
import torch

from conftest import assert_runs_in_a_fresh_process
from moe_reference import BACKENDS, build, random_config, reference_layer
from moefold.config import MoEConfig
from moefold.errors import ConfigError, UserError
from moefold.moe.experts import GroupedMMExperts, LoopExperts, build_experts

# ------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("seed", range(32))
def test_layer_matches_per_token_reference(seed):
    cfg = random_config(seed)
    dim, T = 12, 10
    layer, ref = build(cfg, dim, seed), build(cfg, dim, seed)
    x = torch.randn(2, T // 2, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    x_ref = x.clone().requires_grad_()
    x.requires_grad_()
    upstream = torch.randn(2, T // 2, dim, dtype=torch.float64)

    y = layer(x)
    (y * upstream).sum().backward()
    y_ref = reference_layer(x_ref.view(T, dim), ref, cfg).view_as(x)
    (y_ref * upstream).sum().backward()

    note = f"config: {dataclasses.asdict(cfg)}"
    # Routing probabilities and the combine sum are fp32 by design; everything else is fp64.
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, y_ref, **tol, msg=lambda m: f"{m}\n{note}")
    torch.testing.assert_close(x.grad, x_ref.grad, **tol, msg=lambda m: f"{m}\n{note}")
    for (name, p), p_ref in zip(layer.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, **tol, msg=lambda m: f"{name}: {m}\n{note}")


@pytest.mark.parametrize("pad_to_capacity", [False, True])
def test_a_capacity_above_the_tokens_keeps_every_copy(pad_to_capacity):
    """capacity_factor=1e30: C is capped at T (no expert can get more), so nothing drops, no
    int overflows, and padded groups hold T rows, not 1e30·T·K/E."""
    cfg = dataclasses.replace(random_config(3), capacity_factor=1e30, pad_to_capacity=pad_to_capacity,
                              drop_policy="probs")
    layer, ref = build(cfg, 12, 3), build(cfg, 12, 3)
    x_TD = torch.randn(10, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(layer(x_TD), reference_layer(x_TD, ref, cfg), rtol=1e-5, atol=1e-5)
    assert layer.capacity.capacity(10, cfg.top_k) == 10


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("memory_efficient", [True, False])
def test_experts_without_tokens_get_exact_zero_gradients(backend, memory_efficient):
    cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=8, experts_backend=backend, pad_multiple=8,
                    memory_efficient_permute=memory_efficient, aux_loss_coeff=0.0)
    layer = build(cfg, 16, seed=0).float()
    with torch.no_grad():  # inputs are positive, so experts 1 and 3 (negative rows) never win
        layer.router.weight[1] = -1.0
        layer.router.weight[3] = -2.0
    x = (torch.rand(20, 16) + 0.1).requires_grad_()
    layer(x).square().sum().backward()
    for w in (layer.experts.w1_EDF, layer.experts.w3_EDF, layer.experts.w2_EFD):
        assert torch.isfinite(w.grad).all()
        assert w.grad[1].abs().sum() == 0 and w.grad[3].abs().sum() == 0
        assert w.grad[0].abs().sum() > 0 and w.grad[2].abs().sum() > 0
    assert torch.isfinite(x.grad).all()


def test_memory_efficient_permutation_saves_less_for_backward():
    def saved_bytes(memory_efficient: bool) -> int:
        cfg = MoEConfig(num_experts=8, top_k=2, expert_hidden=64, aux_loss_coeff=0.0,
                        memory_efficient_permute=memory_efficient, experts_backend=BACKENDS[-1])
        layer = build(cfg, 128, seed=0).float()
        x = torch.randn(256, 128, requires_grad=True)
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(x)
        return total

    # Without it, the [T·K, D] expert output and the [T·K, F] activation output are kept.
    assert saved_bytes(True) < saved_bytes(False) - 256 * 2 * 128 * 4


def test_padding_tokens_are_not_routed():
    cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=8, aux_loss_coeff=0.0)
    layer = build(cfg, 16, seed=1).float()
    x = torch.randn(2, 6, 16)
    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[1, 4:] = False
    y = layer(x, valid)
    assert y[1, 4:].abs().sum() == 0
    torch.testing.assert_close(y[0], layer(x[:1])[0])
    assert layer.stats.pop()["tokens_per_expert_E"].sum() == (10 + 6) * 2  # two forwards, K=2


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_an_integer_0_1_mask_is_read_as_the_bool_one(dtype):
    """Hugging Face's attention_mask is int64 0/1: an integer mask failed deep in the layer (an
    int condition to torch.where, a uint8 one to index_put); it routes, counts and balances as the
    bool mask does."""
    cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=8, capacity_factor=1.0, aux_loss_coeff=0.01,
                    z_loss_coeff=0.001)
    layers = [build(cfg, 16, seed=1).float() for _ in range(2)]
    x = torch.randn(2, 6, 16)
    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[1, 4:] = False
    outputs = [layer(x.clone().requires_grad_(), mask) for layer, mask in zip(layers, (valid, valid.to(dtype)))]
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)
    grads = [torch.autograd.grad(y.square().sum(), layer.router.weight)[0] for layer, y in zip(layers, outputs)]
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)  # the aux losses' masks too
    stats = [layer.stats.pop() for layer in layers]
    assert all(torch.equal(stats[1][key], stats[0][key]) for key in stats[0])


@pytest.mark.parametrize("mask, message", [
    (torch.ones(2, 6), "valid_BS has dtype torch.float32; allowed: torch.bool"),
    (torch.ones(6, 2, dtype=torch.bool), r"valid_BS has shape \[6, 2\]; it must be the tokens' \[B, S\] = \[2, 6\]"),
])
def test_a_float_or_misshapen_mask_is_refused_naming_valid_bs(mask, message):
    """A float mask may be additive (0: a token kept), the opposite of a 0/1 one; a transposed
    mask of B·S elements was silently read in the wrong order."""
    layer = build(MoEConfig(num_experts=4, top_k=2, expert_hidden=8), 16, seed=1).float()
    with pytest.raises(UserError, match=message):
        layer(torch.randn(2, 6, 16), mask)


@pytest.mark.parametrize("drop_policy", ["probs", "position"])
def test_padding_never_takes_a_real_tokens_place_under_capacity(drop_policy):
    """With a capacity factor, padding copies rank after every real one: the real tokens' outputs
    do not depend on what the padding holds, and a real copy is dropped only past C real copies,
    C the real tokens' capacity (padding raised it: a padded layout kept what one process drops)."""
    cfg = MoEConfig(num_experts=4, top_k=1, expert_hidden=16, capacity_factor=1.0, drop_policy=drop_policy,
                    aux_loss_coeff=0.0, norm_topk_prob=False)
    layer = build(cfg, 16, seed=2).float().eval()
    real = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(0))
    valid = torch.tensor([[False] * 8 + [True] * 8])  # left padding
    outputs = [layer(torch.cat([padding, real], dim=1), valid)[:, 8:] for padding in
               (torch.zeros(1, 8, 16), 3 * real, -real)]
    for y in outputs[1:]:
        torch.testing.assert_close(y, outputs[0], rtol=0, atol=0)
    capacity = layer.capacity.capacity(8, 1)  # C = 2: of the 8 real tokens, not all 16
    per_expert = torch.bincount(layer.router(real.view(8, 16)).idx_TK.view(-1), minlength=4)
    dropped = int((outputs[0].abs().sum(-1) == 0).sum())
    assert dropped == int((per_expert - capacity).clamp(min=0).sum())


@pytest.mark.skipif(len(BACKENDS) < 2, reason="torch._grouped_mm unavailable on this build")
@pytest.mark.parametrize("seed", range(8))
def test_grouped_mm_backend_matches_loop(seed):
    cfg = random_config(seed)
    layers = []
    for backend in ("loop", "grouped_mm"):
        layers.append(build(dataclasses.replace(cfg, experts_backend=backend), 16, seed).float())
    x = torch.randn(24, 16, generator=torch.Generator().manual_seed(seed))
    outs = []
    for layer in layers:
        x_ = x.clone().requires_grad_()
        y = layer(x_)
        y.square().sum().backward()
        outs.append([y, x_.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_experts_whose_rows_are_not_16_bytes_take_the_loop_or_are_refused():
    """torch._grouped_mm reads rows 16 bytes apart: expert_hidden=3 in fp32 (12 bytes) is not."""
    unaligned = build_experts("auto", 4, 16, 3, "cpu", torch.float32)
    assert isinstance(unaligned, LoopExperts)
    if len(BACKENDS) == 2:  # where this build has grouped_mm at all, aligned rows take it
        assert isinstance(build_experts("auto", 4, 16, 4, "cpu", torch.float32), GroupedMMExperts)
    with pytest.raises(ConfigError, match=r"moe.experts_backend=grouped_mm needs model.dim \(16\) and "
                       r"moe.expert_hidden \(3\) to be multiples of 4 in float32"):
        build_experts("grouped_mm", 4, 16, 3, "cpu", torch.float32)
    for weight in unaligned.parameters():
        torch.nn.init.normal_(weight)
    assert unaligned(torch.randn(6, 16), torch.tensor([2, 1, 3, 0])).isfinite().all()


def _skewed_training_run(expert_bias: bool, steps: int = 150) -> list[float]:
    """Train a sigmoid-routed layer whose router starts strongly skewed; imbalance per step."""
    from moefold.moe.stats import summarize

    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=8, top_k=2, expert_hidden=16, score_func="sigmoid", aux_loss_coeff=0.0,
                    expert_bias=expert_bias, experts_backend="loop")
    if expert_bias:  # without the bias, nothing reads a rate (build_moe_layer refuses one)
        cfg.expert_bias_update_rate = 0.02
    layer = build(cfg, 16, seed=0).float()
    with torch.no_grad():  # inputs share a direction that experts 0 and 1 love
        layer.router.weight[:2] += 2.0
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-3)
    imbalance = []
    for _ in range(steps):
        x = torch.randn(256, 16) + 1.0
        loss = (layer(x) - x.flip(-1)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        layer.on_optimizer_step()
        imbalance.append(summarize([layer.stats.pop()])["load_imbalance"])
    return imbalance


def test_expert_bias_lowers_load_imbalance_of_a_skewed_router():
    with_bias, without = _skewed_training_run(True), _skewed_training_run(False)
    assert with_bias[0] > 3.0 and without[0] > 3.0  # 8 experts, top-2: 4.0 is everything on two
    late_with, late_without = sum(with_bias[-20:]) / 20, sum(without[-20:]) / 20
    assert late_with < 2.0, late_with
    assert late_without > 3.0, late_without


class _GarbagePastTheEnd(torch.autograd.Function):
    """torch._grouped_mm with NaN in every output row past the last group, forward and grad_input:
    what the CUDA kernels (torch's, moefold's Triton ones) may leave in those unwritten rows."""

    @staticmethod
    def forward(ctx, x_RX, w_EXY, offsets_E):
        ctx.save_for_backward(x_RX, w_EXY, offsets_E)
        out = torch._grouped_mm(x_RX, w_EXY, offs=offsets_E)
        out[int(offsets_E[-1]):] = float("nan")
        return out

    @staticmethod
    def backward(ctx, grad_RY):
        x_RX, w_EXY, offsets_E = ctx.saved_tensors
        grad_RY = grad_RY.clone()
        grad_RY[int(offsets_E[-1]):] = 0.0  # what autograd hands back for rows nobody read
        grad_x = torch._grouped_mm(grad_RY, w_EXY.transpose(-2, -1), offs=offsets_E)
        grad_x[int(offsets_E[-1]):] = float("nan")
        return grad_x, torch._grouped_mm(x_RX.t(), grad_RY, offs=offsets_E), None


@pytest.mark.skipif("grouped_mm" not in BACKENDS, reason="needs torch._grouped_mm on the CPU")
@pytest.mark.parametrize("memory_efficient", [True, False])
def test_rows_past_the_last_group_are_never_read(monkeypatch, memory_efficient):
    """The grouped GEMM never writes rows past the last group (the buffer's tail, R = N + E·(m−1)
    rows with padding): the layer must not read them, forward or backward. With NaN there, the
    output and every gradient equal the clean run's."""
    cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=8, experts_backend="grouped_mm", pad_multiple=8,
                    memory_efficient_permute=memory_efficient)
    x = torch.randn(20, 16, generator=torch.Generator().manual_seed(0))
    results = []
    for garbage in (False, True):
        if garbage:
            monkeypatch.setattr("moefold.moe.experts.grouped_mm", _GarbagePastTheEnd.apply)
        layer = build(cfg, 16, seed=0).float()
        xr = x.clone().requires_grad_()
        y = layer(xr)
        y.square().sum().backward()
        results.append([y.detach(), xr.grad, *(p.grad for p in layer.parameters())])
    for clean, dirty in zip(*results):
        assert torch.isfinite(dirty).all()
        torch.testing.assert_close(dirty, clean, rtol=0, atol=0)


@pytest.mark.parametrize("change, message", [
    ({"score_func": "sigmoidd"}, "moe.score_func='sigmoidd' is not one of softmax, sigmoid"),
    ({"top_k": 9}, "moe.top_k=9 exceeds moe.num_experts=8"),
    ({"num_experts": 0}, "moe.num_experts=0 must be > 0 for an MoE layer"),
    ({"num_groups": 3, "group_top_k": 1}, "moe.num_experts=8 is not divisible by moe.num_groups=3"),
    ({"activation": "silu"}, "moe.activation='silu' is not one of swiglu, gelu, relu2"),
])
def test_a_layer_built_in_python_checks_its_config(change, message):
    """A MoEConfig made in Python has met no config check: build_moe_layer runs [moe]'s, a one-line
    ConfigError instead of a silent softmax router or a KeyError deep inside."""
    from moefold.moe.layer import build_moe_layer

    with pytest.raises(ConfigError) as info:
        build_moe_layer(16, MoEConfig(**{"num_experts": 8, "top_k": 2, **change}), "cpu", torch.float32)
    assert str(info.value).startswith(message)


def test_building_a_layer_draws_nothing_from_the_global_generator():
    """The first build probes torch._grouped_mm (cached per process): with random operands it drew
    from the generator a user seeded, so the first model built after torch.manual_seed got other
    weights than the next. In a fresh process, where the probe has not run yet."""
    script = ("import torch\n"
              "from moefold.config import MoEConfig\n"
              "from moefold.moe.layer import build_moe_layer\n"
              "torch.manual_seed(0)\n"
              "build_moe_layer(16, MoEConfig(num_experts=4, top_k=2, expert_hidden=16), 'cpu', torch.float32)\n"
              "drawn = torch.rand(4)\n"
              "torch.manual_seed(0)\n"
              "assert torch.equal(drawn, torch.rand(4)), 'the build drew from the global generator'\n")
    assert_runs_in_a_fresh_process(script)
