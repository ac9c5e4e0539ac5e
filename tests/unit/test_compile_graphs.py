"""`train.compile` compiles each block as one graph: Dynamo traces every block of each family
without a graph break (a break splits the block and stops Inductor fusing across it). Tracing only
(`torch._dynamo.explain`), so no C++ compiler is needed."""

import functools

import pytest
import torch

from moefold.config import load_config
from moefold.models.transformer import build_model
from moefold.train.compile import compile_blocks

FAMILIES = {"tiny-qwen3": {}, "tiny-mixtral": {},
            "tiny-deepseek": {"moe.score_func": "sigmoid", "moe.norm_topk_prob": "true", "moe.expert_bias": "true"}}


@pytest.mark.parametrize("preset", sorted(FAMILIES))
def test_every_block_traces_as_one_graph(preset):
    cfg = load_config(preset, FAMILIES[preset])
    model = build_model(cfg, 257, "cpu", torch.bfloat16)
    model.init_weights(0)
    S = 32
    cos_SDr, sin_SDr = model.rope(S, torch.device("cpu"))
    for i, block in enumerate(model.blocks()):
        x_BSD = torch.randn(2, S, cfg.model.dim, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            explained = torch._dynamo.explain(block.forward)(x_BSD, cos_SDr, sin_SDr)
        reasons = [str(b.reason)[:200] for b in explained.break_reasons]
        assert explained.graph_break_count == 0, f"{preset} block {i}: {reasons}"


@pytest.mark.parametrize("preset", sorted(FAMILIES))
def test_compiled_blocks_give_eager_gradients(preset, monkeypatch):
    """`compile_blocks` as `train.compile` runs it in fp32 (expert GEMMs eager), traced by Dynamo and
    AOTAutograd with the `aot_eager` backend (Inductor's tracing, no C++ compiler): every block
    gives eager's output and gradients, the input's and every parameter's. On torch 2.11 the
    experts' gate/up weights got zero gradients here (pytorch#180642, the activation's no-op
    `.to`), which training on the GPU showed only as a slowly wrong loss."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    cfg = load_config(preset, FAMILIES[preset])
    models = []
    for compiled in (False, True):
        model = build_model(cfg, 257, "cpu", torch.float32)
        model.init_weights(0)
        if compiled:
            compile_blocks(model)
        models.append(model)
    S = 32
    cos_SDr, sin_SDr = models[0].rope(S, torch.device("cpu"))
    x_BSD = torch.randn(2, S, cfg.model.dim, generator=torch.Generator().manual_seed(0))
    for i, blocks in enumerate(zip(models[0].blocks(), models[1].blocks())):
        results = []
        for block in blocks:
            x = x_BSD.clone().requires_grad_()
            out = block(x, cos_SDr, sin_SDr)
            out.square().sum().backward()
            results.append([out.detach(), x.grad, *(p.grad for p in block.parameters())])
        for j, (want, got) in enumerate(zip(*results)):
            assert want is None or got.abs().sum() > 0 or want.abs().sum() == 0
            torch.testing.assert_close(got, want, msg=lambda m: f"{preset} block {i}, tensor {j}: {m}")
