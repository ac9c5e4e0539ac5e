"""`train.compile` compiles each block as one graph: Dynamo traces every block of each family
without a graph break (a break splits the block and stops Inductor fusing across it). Tracing only
(`torch._dynamo.explain`), so no C++ compiler is needed."""

import pytest
import torch

from moefold.config import load_config
from moefold.models.transformer import build_model

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
