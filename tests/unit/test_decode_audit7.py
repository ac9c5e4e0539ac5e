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
from moefold.moe.layer import MoELayer

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


def test_a_decode_step_decompresses_and_routes_its_new_positions_only():
    """No defect, pinned: MLA expands the latent of the new positions only (the cache holds the
    expanded keys and values, never the latent to expand again), and the MoE layers route the new
    tokens only (no buffer sized to the context)."""
    model = _model("tiny-deepseek")
    latent_rows = [_rows_into(layer.attn.wkv_b) for layer in model.layers]
    # the main layers': decode runs no MTP module
    routed_rows = [_rows_into(layer.ffn.router) for layer in model.layers if isinstance(layer.ffn, MoELayer)]
    cache = model.new_cache(12)
    for piece in _ids(12).split([6, 1, 1, 2, 1, 1], dim=1):
        model.decode(piece, cache)
    assert routed_rows and all(rows == [12, 2, 2, 4, 2, 2] for rows in routed_rows)  # B·S tokens
    assert all(rows == [6, 1, 1, 2, 1, 1] for rows in latent_rows)


# ---------------------------------------------------------------------------------------------
# A sliding window reads the keys within it only
# ---------------------------------------------------------------------------------------------

WINDOW = 5


def _attention_reads(monkeypatch) -> list[tuple[int, tuple | None]]:
    """A list that gets (keys, the attn_mask's shape or None) of every SDPA call from now on."""
    reads: list[tuple[int, tuple | None]] = []
    real = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, **kw):
        reads.append((k.shape[-2], None if attn_mask is None else tuple(attn_mask.shape)))
        return real(q, k, v, attn_mask=attn_mask, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return reads


def test_a_decode_step_past_the_window_attends_over_the_window_only(monkeypatch):
    """A token after P > W cached ones attended over all P + 1 keys through a [1, P + 1] mask
    built for it: O(P) work a token where the window needs O(W)."""
    model = _model("tiny-mixtral", **{"model.sliding_window": str(WINDOW)})
    n_layers = len(model.layers)
    ids_BS = _ids(23)
    full_BSV = model(ids_BS)
    reads = _attention_reads(monkeypatch)
    cache, pieces, start = model.new_cache(23), [8] + [1] * 12 + [3], 0
    for n in pieces:
        got_BSV = model.decode(ids_BS[:, start:start + n], cache)
        torch.testing.assert_close(got_BSV, full_BSV[:, start:start + n], rtol=1e-9, atol=1e-10)
        start += n
    per_call = reads[::n_layers]
    assert reads == [read for read in per_call for _ in range(n_layers)]
    assert per_call[0] == (8, (8, 8))  # the prompt: every key, the windowed causal mask
    assert per_call[1:13] == [(min(p + 1, WINDOW), None) for p in range(8, 20)]  # was (p + 1, (1, p + 1))
    assert per_call[13] == (7, (3, 7))  # keys 16..22: the earliest any of queries 20..22 sees


def _naive_windowed_attention(q_SD, k_PD, v_PD, start, window):
    """softmax over every key 0..P−1 with the causal window written out: the reference."""
    distance_SP = torch.arange(start, start + q_SD.shape[0])[:, None] - torch.arange(k_PD.shape[0])[None, :]
    allowed_SP = (distance_SP >= 0) & (distance_SP < window)
    scores_SP = (q_SD @ k_PD.T / q_SD.shape[-1] ** 0.5).masked_fill(~allowed_SP, float("-inf"))
    return scores_SP.softmax(-1) @ v_PD


@pytest.mark.parametrize("window", [1, 2, 3, 6])
def test_window_masks_over_the_keys_from_the_first_visible_give_naive_attention(window):
    from moefold.models.attention import SlidingWindowMask

    mask = SlidingWindowMask(window)
    gen = torch.Generator().manual_seed(0)
    for start in range(9):
        for num_new in range(1, 5):
            P, first = start + num_new, mask.first_key(start)
            q, k, v = (torch.randn(n, 8, generator=gen, dtype=torch.float64) for n in (num_new, P, P))
            got = F.scaled_dot_product_attention(q[None], k[None, first:], v[None, first:],
                                                 **mask(start, num_new, "cpu", first))[0]
            torch.testing.assert_close(got, _naive_windowed_attention(q, k, v, start, window), rtol=1e-12, atol=1e-12,
                                       msg=lambda m, s=start, n=num_new: f"start {s}, {n} new: {m}")


@pytest.mark.parametrize("window", [3, 6])
def test_greedy_sampling_with_a_window_is_transformers_greedy_generate(window, tmp_path):
    """Mixtral with a sliding window, 30 tokens past a prompt of 5: moefold's cache reads the
    window only, transformers' generate keeps its own cache; the same tokens."""
    pytest.importorskip("transformers")
    from test_hf_interop import hf_model_of, mixtral

    from moefold.checkpoint.hf import load_pretrained

    hf = hf_model_of(mixtral(sliding_window=window))
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    prompt = [5, 17, 3, 42, 8]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
    assert sample(ours, prompt, 30, 0.0, 0, 64, -1, torch.Generator()) == want
