"""`train.compile` (each block under torch.compile) trains like eager on the GPU: every step's loss
and gradient norm to 1e-4 in fp32, and to 1e-2 in bf16 autocast, for Qwen3-MoE and DeepSeek-V3."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
from layouts import config, train  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype, rtol", [("fp32", 1e-4), ("bf16", 1e-2)])
@pytest.mark.parametrize("model", ["qwen3", "deepseek"])
def test_compiled_blocks_train_like_eager(model, dtype, rtol, text_corpus, tmp_path):
    base = {"train.device": "cuda", "precision.compute_dtype": dtype}
    eager = train(config(model, text_corpus, extra=base), tmp_path / "eager")
    compiled = train(config(model, text_corpus, extra={**base, "train.compile": "true"}), tmp_path / "compiled")
    for key in ("losses", "grad_norms"):
        torch.testing.assert_close(torch.tensor(compiled[key]), torch.tensor(eager[key]), rtol=rtol, atol=0,
                                   msg=lambda m, key=key: f"{model} {dtype} {key}: {m}")
