"""Audit 15 of generation's KV cache: a sliding-window layer's cache holds what its window can still
see, not the whole context (Mixtral's W = 4096 decoding 32k tokens kept 8x the keys it needed).
Against the reference a cache must reproduce by definition, the no-cache forward over each
position's prefix: tiny-mixtral as shipped (W = 64) and with W = 8, read one token at a time and in
chunks shorter and longer than W, far past W. The memory is measured on the tensors themselves (the
storages the cache references between calls, the keys SDPA reads in a call), not on a counter.
Full-attention layers (GQA, MLA, a window the capacity never passes) keep one buffer of the
capacity, and every cache still refuses positions past its capacity (RoPE's positions and
`sample`'s restart at a full context count on it).

B batch, S new positions, W sliding window, V vocabulary.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

from moefold.generate import sample
from moefold.models.kv_cache import LayerCache
from test_decode_audit7 import _ids
from test_kv_cache import _model, _sample_by_full_forwards

SMALL_WINDOW = 8


def _mixtral(window: int):
    """tiny-mixtral in fp64 (test_kv_cache's `_model`), its window `window`."""
    return _model("tiny-mixtral", {"model.sliding_window": str(window)})


@functools.cache
def _reference(window: int, seq_len: int):
    """The model of `window`, `seq_len` ids, and each position's logits from the no-cache forward
    over its prefix alone (computed once for every case that reads them)."""
    model, ids_BS = _mixtral(window), _ids(seq_len)
    with torch.no_grad():
        prefix_BSV = torch.stack([model(ids_BS[:, :p + 1])[:, -1] for p in range(seq_len)], dim=1)
    return model, ids_BS, prefix_BSV


def _decode_in_pieces(model, ids_BS: torch.Tensor, pieces: list[int]):
    """The logits of `ids_BS` decoded `pieces` positions a call, into a cache of its length; and the cache."""
    assert sum(pieces) == ids_BS.shape[1]
    cache = model.new_cache(ids_BS.shape[1])
    logits_BSV = torch.cat([model.decode(piece_BS, cache) for piece_BS in ids_BS.split(pieces, dim=1)], dim=1)
    assert cache.length == ids_BS.shape[1]
    return logits_BSV, cache


# Chunks below, at and above W, single tokens between, each read straddling the ring's wrap somewhere.
CASES = {
    "W8-token-by-token": (SMALL_WINDOW, [1] * 48),
    "W8-mixed": (SMALL_WINDOW, [3, 1, 12, 1, 1, 7, 8, 9, 1, 2, 3]),
    "W8-prompt-longer-than-W": (SMALL_WINDOW, [19, 1, 1, 1, 17, 1, 1, 1, 6]),
    "W64-token-by-token": (64, [1] * 140),
    "W64-mixed": (64, [10, 1, 65, 1, 1, 56, 1, 3, 2]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_windowed_decoding_gives_the_forward_over_each_prefix(case):
    window, pieces = CASES[case]
    model, ids_BS, prefix_BSV = _reference(window, sum(pieces))
    got_BSV, _ = _decode_in_pieces(model, ids_BS, pieces)
    torch.testing.assert_close(got_BSV, prefix_BSV, rtol=1e-9, atol=1e-10,
                               msg=lambda m: f"{case}: {m}")


def _cache_bytes(layer_cache) -> int:
    """Bytes of the storages the layer's cache references (a view's whole storage counted)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in vars(layer_cache).values() if isinstance(t, torch.Tensor)}
    return sum(storages.values())


def _keys_read(monkeypatch) -> list[tuple[int, int]]:
    """A list that gets (new queries S, positions of key storage SDPA reads) for every call from now on."""
    reads: list[tuple[int, int]] = []
    real = F.scaled_dot_product_attention

    def recording(q, k, v, *args, **kw):
        position_bytes = k.shape[0] * k.shape[1] * k.shape[3] * k.element_size()
        reads.append((q.shape[2], k.untyped_storage().nbytes() // position_bytes))
        return real(q, k, v, *args, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return reads


def test_a_windowed_layer_holds_the_window_s_keys_only(monkeypatch):
    """Before: every layer kept a buffer of the capacity (48 positions here, for W = 8). Now the
    keys and values a layer keeps between calls are W positions (the W − 1 the next query still
    sees, and the slot the next token's key takes), and those SDPA reads in a call at most
    W − 1 + S (the window's, then the S new ones: a chunk may be longer than W)."""
    model = _mixtral(SMALL_WINDOW)
    B, capacity = 2, 48
    ids_BS = _ids(capacity, batch=B)
    kv_heads, head_dim = model.cfg.model.n_kv_heads, model.cfg.model.head_dim
    window_bytes = 2 * B * kv_heads * SMALL_WINDOW * head_dim * 8  # keys and values, fp64
    reads = _keys_read(monkeypatch)
    cache, pieces = model.new_cache(capacity), [3, 1, 12, 1, 1, 7, 8, 9, 1, 2, 3]
    with torch.no_grad():
        for piece_BS in ids_BS.split(pieces, dim=1):
            model.decode(piece_BS, cache)
            held = [_cache_bytes(layer_cache) for layer_cache in cache.layers]
            assert held == [window_bytes] * len(model.layers), (cache.length, held, window_bytes)
    assert len(reads) == len(pieces) * len(model.layers)
    for (S, key_positions), piece in zip(reads, [n for n in pieces for _ in model.layers], strict=True):
        assert S == piece and key_positions <= SMALL_WINDOW - 1 + S, (S, key_positions)


@pytest.mark.parametrize("preset, overrides", [("tiny-qwen3", {}), ("tiny-deepseek", {}),
                                               ("tiny-mixtral", {"model.sliding_window": "0"}),
                                               ("tiny-mixtral", {"model.sliding_window": "23"})],
                         ids=["gqa", "mla", "mixtral-no-window", "window-of-the-capacity"])
def test_full_attention_layers_keep_one_buffer_of_the_capacity(preset, overrides):
    """Today's cache for layers that see every key, and for a window as long as the capacity
    (nothing to evict): one buffer of the capacity, read without a copy."""
    model = _model(preset, overrides)
    capacity, ids_BS = 23, _ids(23)
    got_BSV, cache = _decode_in_pieces(model, ids_BS, [7, 1, 1, 14])
    with torch.no_grad():
        torch.testing.assert_close(got_BSV, model(ids_BS), rtol=1e-9, atol=1e-10)
    assert all(type(layer_cache) is LayerCache for layer_cache in cache.layers)
    for layer_cache in cache.layers:
        assert layer_cache.k_BKLDk.shape[2] == layer_cache.v_BKLDv.shape[2] == capacity


def test_a_windowed_cache_refuses_positions_past_its_capacity():
    """The capacity counts positions read, not keys kept: RoPE's tables and `sample`'s restart
    once `cache.length` reaches the context are bounded by it."""
    model = _mixtral(SMALL_WINDOW)
    ids_BS = _ids(21)
    cache = model.new_cache(20)
    with torch.no_grad():
        model.decode(ids_BS[:, :11], cache)
        model.decode(ids_BS[:, 11:20], cache)
        assert cache.length == 20
        with pytest.raises(ValueError, match="KV cache of 20 positions cannot take 1 more after 20"):
            model.decode(ids_BS[:, 20:], cache)
    assert cache.length == 20


def test_a_windowed_cache_refuses_a_batch_other_than_the_cached_one():
    model = _mixtral(SMALL_WINDOW)
    ids_BS = _ids(12)
    cache = model.new_cache(12)
    with torch.no_grad():
        model.decode(ids_BS[:, :10], cache)
        with pytest.raises(ValueError, match="KV cache of 2 sequences cannot take a batch of 1"):
            model.decode(ids_BS[:1, 10:11], cache)
        assert cache.length == 10
        torch.testing.assert_close(model.decode(ids_BS[:, 10:], cache), model(ids_BS)[:, 10:], rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("temperature, top_k", [(0.0, 0), (1.0, 10)], ids=["greedy", "sampled"])
def test_sampling_with_windowed_caches_picks_what_full_forwards_pick(temperature, top_k):
    """`sample` with a context past the window (the windowed cache), run past the context (read
    anew each token once full)."""
    model = _mixtral(SMALL_WINDOW)
    prompt, context = [5, 17, 3, 42, 8, 11, 60, 2, 9, 31, 4], 16
    got = sample(model, prompt, 20, temperature, top_k, context, -1, torch.Generator().manual_seed(3))
    want = _sample_by_full_forwards(model, prompt, 20, temperature, top_k, context, -1,
                                    torch.Generator().manual_seed(3))
    assert got == want and len(got) == 20
