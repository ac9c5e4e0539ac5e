"""Generation's KV cache on the GPU: `Transformer.decode` read as a prompt and then token by token
gives the full forward's logits (fp32, SDPA's CUDA kernels on both sides), for GQA with QK-norm,
MLA with YaRN and a sliding window; tests/unit/test_kv_cache.py checks the same in fp64 on CPU."""

import pytest
import torch

from moefold.config import load_config
from moefold.models.transformer import build_model

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.mark.parametrize("preset, overrides", [("tiny-qwen3", {}), ("tiny-deepseek", {}),
                                               ("tiny-mixtral", {"model.sliding_window": "9"})])
def test_decoding_token_by_token_gives_the_full_forward_s_logits(preset, overrides):
    cfg = load_config(preset, overrides)
    with torch.device("cuda"):
        model = build_model(cfg, 97, "cuda", torch.float32).eval()
    model.init_weights(0)
    ids_BS = torch.randint(0, 97, (2, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.no_grad():
        full_BSV = model(ids_BS)
    cache = model.new_cache(40)
    got = [model.decode(ids_BS[:, :16], cache)] + [model.decode(ids_BS[:, t:t + 1], cache) for t in range(16, 40)]
    torch.testing.assert_close(torch.cat(got, dim=1), full_BSV, rtol=1e-4, atol=1e-4)
