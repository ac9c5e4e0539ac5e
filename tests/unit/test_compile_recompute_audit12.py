"""memory.recompute 'moe_act' under train.compile: its output discarding breaks each MoE block's
compiled graph, which made the step 1.9x as long on an H100 (docs/benchmarks.md, 2026-12-06), so
the trainer says so. Traced by Dynamo only (`torch._dynamo.explain`) or with the aot_eager backend:
no C++ compiler needed."""

import functools

import pytest
import torch

from moefold.cli import main
from moefold.config import load_config
from moefold.models.transformer import build_model
from moefold.train.compile import recompute_warnings


def _graph_breaks(recompute: str) -> int:
    cfg = load_config("tiny-qwen3", {"model.n_layers": "1", "memory.recompute": recompute})
    model = build_model(cfg, 64, "cpu", torch.bfloat16)
    model.init_weights(seed=0)
    S = 16
    cos_SDr, sin_SDr = model.rope(S, torch.device("cpu"))
    x_BSD = torch.randn(2, S, cfg.model.dim, requires_grad=True)
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return torch._dynamo.explain(model.layers[0].forward)(x_BSD, cos_SDr, sin_SDr).graph_break_count


def test_a_recomputed_moe_act_breaks_the_compiled_block_which_the_warning_is_for():
    """If this starts failing because moe_act traces whole, drop the warning with it."""
    assert _graph_breaks("[]") == 0
    assert _graph_breaks('["moe_act"]') > 0
    assert _graph_breaks('["attn_core"]') == 0  # a checkpoint the compiler traces: no warning
    assert recompute_warnings(["attn_core", "moe"]) == []
    assert len(recompute_warnings(["moe_act"])) == 1


@pytest.mark.parametrize("compile_blocks", ["true", "false"])
def test_the_trainer_warns_of_moe_act_under_compile_only(compile_blocks, tiny_args, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    args = [*tiny_args, "--train.steps", "2", "--train.warmup_steps", "1", "--train.compile", compile_blocks,
            "--memory.recompute", '["moe_act"]', "--precision.compute_dtype", "fp32"]
    assert main(["train", "--run-dir", str(tmp_path / "run"), *args]) == 0
    warned = [line for line in capsys.readouterr().out.splitlines() if "'moe_act' splits" in line]
    assert len(warned) == (compile_blocks == "true")
