"""Audit 7 of generation's per-token cost: the work one decode step does beyond attention over the
cache, counted by shape recorders (never timed, so deterministic), with the logits checked against
the model's full forward and the tokens against transformers' greedy `generate`.

B batch, S new positions, P positions cached, V vocabulary, W sliding window.
"""

import pytest
import torch
import torch.nn.functional as F

from moefold.config import load_config
from moefold.generate import _pick, sample
from moefold.models.transformer import build_model

FP32_ATOL = 1e-6


def _model(preset: str, dtype=torch.float64, **overrides):
    # fp64 by default: grouped_mm has no fp64 kernel, and an fp32 router rounds differently by shape
    cfg = load_config(preset, {"moe.experts_backend": "loop", "moe.router_dtype": "fp64", **overrides})
    model = build_model(cfg, 97).to(dtype).eval()
    model.init_weights(0)
    return model


def _ids(seq_len: int, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 97, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def _rows_into(module: torch.nn.Module) -> list[int]:
    """A list that gets the rows (positions) of every input `module` reads from now on."""
    rows: list[int] = []
    module.register_forward_pre_hook(lambda _, args: rows.append(args[0].shape[-2]))
    return rows


def _sample_by_full_forwards(model, prompt_ids, max_new_tokens, context):
    """Greedy sampling as it was without a cache: each token from a full forward of the latest `context`."""
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        ids.append(_pick(model(torch.tensor([ids[-context:]]))[0, -1].float(), 0.0, 0, torch.Generator()))
    return ids[len(prompt_ids):]


# ---------------------------------------------------------------------------------------------
# The output head reads the last position only
# ---------------------------------------------------------------------------------------------


def test_sampling_sends_one_position_per_read_to_the_output_head():
    """The prompt's read, and each re-read of `context` tokens once the window is full, ran the
    head over every position ([S, V] logits: 25 GB fp32 for a 40960-token prompt at Qwen3's
    vocabulary) to keep the last row."""
    model = _model("tiny-qwen3")
    head_rows = _rows_into(model.output)
    prompt, context = [5, 17, 3, 42, 8, 11, 60], 9  # 7 tokens: 2 new ones fill the window
    got = sample(model, prompt, 6, 0.0, 0, context, -1, torch.Generator())
    assert head_rows == [1] * 6  # was [7, 1, 1, 9, 9, 9]
    assert got == _sample_by_full_forwards(model, prompt, 6, context)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-deepseek"])
def test_decode_keeps_the_logits_asked_for_and_they_are_the_full_forwards(preset):
    model = _model(preset, torch.float32)
    ids_BS = _ids(12)
    with torch.no_grad():
        full_BSV = model(ids_BS)
        cache = model.new_cache(12)
        last_BSV = model.decode(ids_BS[:, :8], cache, logits_to_keep=1)
        two_BSV = model.decode(ids_BS[:, 8:11], cache, logits_to_keep=2)
        every_BSV = model.decode(ids_BS[:, 11:], cache)  # the default: every position
    assert last_BSV.shape == (2, 1, 97) and two_BSV.shape == (2, 2, 97) and every_BSV.shape == (2, 1, 97)
    torch.testing.assert_close(last_BSV, full_BSV[:, 7:8], rtol=0, atol=FP32_ATOL)
    torch.testing.assert_close(two_BSV, full_BSV[:, 9:11], rtol=0, atol=FP32_ATOL)
    torch.testing.assert_close(every_BSV, full_BSV[:, 11:], rtol=0, atol=FP32_ATOL)
