"""memory.recompute under train.compile: 'moe_act''s output discarding (its eager form) broke each
MoE block's compiled graph, which made the step 1.9x as long on an H100 (docs/benchmarks.md,
2026-12-06), so build_model gives compiled blocks its checkpointed form, which traces whole
(test_compile_moe_act_audit12); the trainer's warning of the split went with it. Traced by Dynamo
only (`torch._dynamo.explain`) or with the aot_eager backend: no C++ compiler needed."""

import functools

import pytest
import torch

from moefold.cli import main
from moefold.config import load_config
from moefold.models.transformer import build_model


def _graph_breaks(recompute: str, compiled: str = "true") -> int:
    """The first block's graph breaks, built for compiled blocks (train.compile) or not."""
    cfg = load_config("tiny-qwen3", {"model.n_layers": "1", "memory.recompute": recompute,
                                     "train.compile": compiled})
    model = build_model(cfg, 64, "cpu", torch.bfloat16)
    model.init_weights(seed=0)
    S = 16
    cos_SDr, sin_SDr = model.rope(S, torch.device("cpu"))
    x_BSD = torch.randn(2, S, cfg.model.dim, requires_grad=True)
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return torch._dynamo.explain(model.layers[0].forward)(x_BSD, cos_SDr, sin_SDr).graph_break_count


def test_moe_act_built_for_compiled_blocks_traces_whole_where_its_eager_form_breaks():
    """The eager form (output discarding) traced breaks 8 times (9 graphs): why build_model picks
    the form by train.compile."""
    assert _graph_breaks("[]") == 0
    assert _graph_breaks('["moe_act"]') == 0
    assert _graph_breaks('["moe_act"]', compiled="false") == 8
    assert _graph_breaks('["attn_core"]') == 0


@pytest.mark.parametrize("compile_blocks", ["true", "false"])
def test_the_trainer_trains_moe_act_compiled_or_not_and_warns_of_nothing(compile_blocks, tiny_args, tmp_path,
                                                                         monkeypatch, capsys):
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    args = [*tiny_args, "--train.steps", "2", "--train.warmup_steps", "1", "--train.compile", compile_blocks,
            "--memory.recompute", '["moe_act"]', "--precision.compute_dtype", "fp32"]
    assert main(["train", "--run-dir", str(tmp_path / "run"), *args]) == 0
    assert "warning" not in capsys.readouterr().out
