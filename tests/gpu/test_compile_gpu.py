"""`train.compile` (each block under torch.compile) trains like eager on the GPU, for Qwen3-MoE and
DeepSeek-V3, within the tolerances of the NCCL layout tests (gpu_runs.DTYPES): fp32 losses and
gradient norms to 1e-4 (the expert GEMMs eager there), bf16 losses to 1e-2."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
from gpu_runs import assert_same_training  # noqa: E402
from layouts import config, train  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("model", ["qwen3", "deepseek"])
def test_compiled_blocks_train_like_eager(model, dtype, text_corpus, tmp_path):
    base = {"train.device": "cuda", "precision.compute_dtype": dtype}
    eager = train(config(model, text_corpus, extra=base), tmp_path / "eager")
    compiled = train(config(model, text_corpus, extra={**base, "train.compile": "true"}), tmp_path / "compiled")
    assert_same_training(compiled, eager, dtype, f"compiled {model} {dtype}")


# Recompute under compile: checkpointed regions inside compiled blocks (moe_act and layer hold the
# routing tape's context_fn; attn_core and shared_experts hold no MoE layer, so none). Each trains
# as the compiled run without recompute, in the dtype's tolerance.
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("model,sites", [("qwen3", '["attn_core"]'), ("qwen3", '["moe_act"]'),
                                         ("deepseek", '["attn_core", "moe_act", "shared_experts"]'),
                                         ("deepseek", '["layer"]')])
def test_compiled_blocks_with_recompute_train_like_without(model, sites, dtype, text_corpus, tmp_path):
    base = {"train.device": "cuda", "precision.compute_dtype": dtype, "train.compile": "true"}
    plain = train(config(model, text_corpus, extra=base), tmp_path / "plain")
    recomputed = train(config(model, text_corpus, extra={**base, "memory.recompute": sites}),
                       tmp_path / "recomputed")
    assert_same_training(recomputed, plain, dtype, f"compiled {model} {dtype} recompute {sites}")
