"""memory.recompute 'moe_act' under train.compile: a checkpoint over the activation and the down
GEMM that keeps the GEMM's output (a selective checkpoint policy) and recomputes the activation,
which Dynamo traces into the block's one graph. The output discarding used without compile broke
each MoE block's graph 8 times (9 graphs), which made the step 1.9x as long on an H100
(docs/benchmarks.md, 2026-12-06). Traced by Dynamo only (`torch._dynamo.explain`) or with the
aot_eager backend (AOTAutograd's partitioner, as Inductor's): no C++ compiler needed."""

import functools

import pytest
import torch
from memory_runs import (
    assert_identical,
    build,
    one_thread,  # noqa: F401 (autouse fixture)
    train,
)
from torch._dynamo.backends.debugging import aot_eager
from torch._functorch.aot_autograd import make_boxed_func

from moefold.config import load_config
from moefold.fp8.apply import apply_fp8
from moefold.memory.sites import is_wrapped
from moefold.models.transformer import build_model
from moefold.moe.experts import Fp8GroupedExperts
from moefold.train.compile import compile_blocks

PRESETS = {"qwen3": "tiny-qwen3", "deepseek": "tiny-deepseek"}
COMPILED_MOE_ACT = {"train.compile": "true", "memory.recompute": '["moe_act"]'}


def _moe_block(model):
    return next(block for block in model.layers if hasattr(block.ffn, "experts"))


def _bf16_block_inputs(model, seed: int = 0):
    S = 16
    cos_SDr, sin_SDr = model.rope(S, torch.device("cpu"))
    x_BSD = torch.randn(2, S, model.cfg.model.dim, generator=torch.Generator().manual_seed(seed))
    return x_BSD.requires_grad_(), cos_SDr, sin_SDr


def _bf16_model(preset: str, overrides: dict[str, str], fp8: bool = False):
    cfg = load_config(PRESETS[preset], {**overrides, **({"precision.fp8": "rowwise"} if fp8 else {})})
    model = build_model(cfg, 64, "cpu", torch.bfloat16)
    model.init_weights(seed=0)
    if fp8:
        apply_fp8(model, cfg.precision, "cpu")
    return model


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_compiled_block_with_moe_act_recomputed_traces_as_one_graph(preset):
    model = _bf16_model(preset, COMPILED_MOE_ACT)
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(_moe_block(model).forward)(*_bf16_block_inputs(model))
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]
    assert is_wrapped(_moe_block(model).ffn.experts, "_down")  # the compiled form, not the pair


def _aot_eager(monkeypatch):
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))


def _compiled_run(config: str, overrides: dict[str, str], fp8: bool):
    """build()'s fp32 model (expert GEMMs eager, moe/grouped_mm.py), FP8 converted as the trainer
    converts it, its blocks compiled, trained 2 steps of 2 micro-batches."""
    model = build(config, {"train.compile": "true", **overrides})
    if fp8:
        apply_fp8(model, model.cfg.precision, "cpu")
        assert all(isinstance(layer.experts, Fp8GroupedExperts) for layer in model.moe_layers())
    # The checkpoint carried over to the FP8 experts (memory/sites.rewrap): a dropped one trains
    # the same, so it is checked here.
    recomputed = "moe_act" in overrides.get("memory.recompute", "")
    assert all(is_wrapped(layer.experts, "_down") == recomputed for layer in model.moe_layers())
    compile_blocks(model)
    torch._dynamo.reset()
    return train(model)


# Each preset once and each mode once (all four pairs cost ~110 s of the CI machine's 2 cores).
@pytest.mark.parametrize("config,fp8", [("qwen3", False), ("deepseek", True)],
                         ids=["qwen3-fp32", "deepseek-fp8-rowwise"])
def test_compiled_training_with_moe_act_recomputed_is_bit_identical(config, fp8, monkeypatch):
    _aot_eager(monkeypatch)
    fp8_options = {"precision.fp8": "rowwise"} if fp8 else {}
    run = _compiled_run(config, {**fp8_options, "memory.recompute": '["moe_act"]'}, fp8)
    assert_identical(run, _compiled_run(config, fp8_options, fp8))


class _BackwardInputs:
    """A backend as aot_eager (its partitioner) that records the tensors each compiled backward
    reads from its forward (the saved activations), and how many grouped GEMMs it runs."""

    def __init__(self):
        self.saved: list[torch.Tensor] = []
        self.backward_gemms = 0

    def backend(self, gm, example_inputs):
        return aot_eager(gm, example_inputs, bw_compiler=self._backward)

    def _backward(self, gm, example_inputs):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        num_saved = sum(not n.name.startswith("tangents") for n in placeholders)
        self.backward_gemms += sum(n.target == torch.ops.aten._grouped_mm.default for n in gm.graph.nodes)
        inner = make_boxed_func(gm.forward)

        def run(args):
            self.saved += [a.detach().clone() for a in args[:num_saved] if isinstance(a, torch.Tensor)]
            return inner(args)
        run._boxed_call = True
        return run


def _activation_output(model, inputs) -> torch.Tensor:
    """h, the experts' activation output, of an eager forward of the MoE block."""
    experts, outputs = _moe_block(model).ffn.experts, []
    down = experts._down

    def recording_down(probs_R, hidden_RF, w2_EFD, offsets_E):
        outputs.append(experts.activation(probs_R, *hidden_RF).to(w2_EFD.dtype).detach())
        return down(probs_R, hidden_RF, w2_EFD, offsets_E)
    experts._down = recording_down
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _moe_block(model)(*inputs)
    del experts._down
    return outputs[0]


def _compiled_block_backward(model, inputs) -> tuple[_BackwardInputs, list[torch.Tensor]]:
    """What the compiled MoE block's backward read, and the gradients (the input's, then the
    block's parameters')."""
    recorder = _BackwardInputs()
    torch._dynamo.reset()
    block = _moe_block(model)
    compiled = torch.compile(block.forward, backend=recorder.backend, dynamic=False)
    x_BSD = inputs[0].detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_BSD = compiled(x_BSD, *inputs[1:])
    out_BSD.float().square().sum().backward()
    return recorder, [x_BSD.grad, *(p.grad for p in block.parameters())]


def _keeps(saved: list[torch.Tensor], h_RF: torch.Tensor) -> bool:
    return any(torch.equal(t, h) for t in saved for h in (h_RF, h_RF.t()) if t.shape == h.shape)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8-rowwise"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_the_compiled_block_keeps_no_activation_output_and_runs_the_down_gemm_once(preset, fp8):
    """bf16 autocast, so the grouped GEMMs and the checkpoint are in the block's one graph, as on a
    GPU. The plain compiled bf16 block keeps h (transposed, for w2's gradient): the measure sees it
    there. The emulated FP8 block's partitioner recomputes h on its own (it keeps gate and up for
    the activation's backward anyway): there the test only guards that moe_act keeps no more.
    Gradients bit for bit with the plain compiled block."""
    plain = _bf16_model(preset, {"train.compile": "true"}, fp8)
    inputs = _bf16_block_inputs(plain)
    h_RF = _activation_output(plain, inputs)
    plain_saved, plain_grads = _compiled_block_backward(plain, inputs)
    recomputed = _bf16_model(preset, COMPILED_MOE_ACT, fp8)
    recomputed_saved, recomputed_grads = _compiled_block_backward(recomputed, inputs)
    if not fp8:
        assert _keeps(plain_saved.saved, h_RF)
    assert not _keeps(recomputed_saved.saved, h_RF)
    assert _nbytes(recomputed_saved.saved) <= _nbytes(plain_saved.saved) - (0 if fp8 else h_RF.nbytes)
    assert recomputed_saved.backward_gemms == plain_saved.backward_gemms  # the GEMM not recomputed
    for i, (got, want) in enumerate(zip(recomputed_grads, plain_grads, strict=True)):
        assert torch.equal(got, want), f"gradient {i} differs"


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors)
