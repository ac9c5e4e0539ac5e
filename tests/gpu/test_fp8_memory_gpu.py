"""FP8 with 'moe_act' recomputed or offloaded on the GPU (the Triton FP8 kernels, eager and with
compiled blocks): trains like the same FP8 run without the memory option, within bf16's
tolerance (gpu_runs.DTYPES). The CPU twin, bit for bit with the emulated GEMMs and the saved
bytes to the byte: tests/unit/test_fp8_memory_audit12.py."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
from gpu_runs import assert_same_training  # noqa: E402
from layouts import config, train  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("compile_blocks", ["false", "true"])
@pytest.mark.parametrize("memory", [{"memory.recompute": '["moe_act"]'},
                                    {"memory.recompute": '["moe_act"]', "precision.fp8_saved_activations": "true"},
                                    {"memory.offload": '["moe_act"]', "memory.offload_min_bytes": "0"}],
                         ids=["recompute", "recompute-fp8-kept", "offload"])
@pytest.mark.parametrize("model", ["qwen3", "deepseek"])
def test_fp8_with_moe_act_wrapped_trains_like_without(model, memory, compile_blocks, text_corpus, tmp_path):
    base = {"train.device": "cuda", "precision.compute_dtype": "bf16", "precision.fp8": "rowwise",
            "train.compile": compile_blocks,
            "precision.fp8_saved_activations": memory.get("precision.fp8_saved_activations", "false")}
    plain = train(config(model, text_corpus, extra=base), tmp_path / "plain")
    wrapped = train(config(model, text_corpus, extra={**base, **memory}), tmp_path / "wrapped")
    assert_same_training(wrapped, plain, "bf16", f"fp8 {model} {memory} compile={compile_blocks}")
