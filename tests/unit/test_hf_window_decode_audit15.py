"""A sliding-window model's cached decoding against transformers' (audit 15): tiny Mixtral with a
window of 6, loaded from transformers' own checkpoint, read past the window in chunks shorter and
longer than it, then one token at a time. transformers' cache and mask for sliding windows are an
implementation independent of moefold's ring (models/kv_cache.py WindowLayerCache): each chunk's
logits must equal transformers' for the same chunk after the same cached prefix."""

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_interop import VOCAB, assert_rel_close, hf_model_of, mixtral  # noqa: E402

from moefold.checkpoint.hf import load_pretrained  # noqa: E402
from moefold.models.kv_cache import WindowLayerCache  # noqa: E402

WINDOW = 6
PIECES = [4, 1, 9, 1, 1, 6, 2, 1, 1, 1, 1, 7, 1, 1]  # 37 positions: six windows, every wrap of the ring


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    hf = hf_model_of(mixtral(sliding_window=WINDOW, max_position_embeddings=64), seed=3)
    path = tmp_path_factory.mktemp("window")
    hf.save_pretrained(path)
    return hf, load_pretrained(path)


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, sum(PIECES)), generator=torch.Generator().manual_seed(5))


def _hf_decoded(hf, ids_BS: torch.Tensor) -> list[torch.Tensor]:
    """transformers' logits of each piece after the pieces before it, read through its cache."""
    cache, read, out = transformers.DynamicCache(config=hf.config), 0, []
    # the argument is `past_key_values` in transformers 5.0, `cache` in later 5.x
    cache_arg = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    with torch.no_grad():
        for piece_BS in ids_BS.split(PIECES, dim=1):
            positions_S = torch.arange(read, read + piece_BS.shape[1])
            result = hf(piece_BS, use_cache=True, cache_position=positions_S,
                        position_ids=positions_S[None].expand(piece_BS.shape[0], -1), **{cache_arg: cache})
            out.append(result.logits)
            read += piece_BS.shape[1]
    return out


def test_windowed_decoding_gives_transformers_cached_logits(models):
    hf, ours = models
    ids_BS = _ids()
    cache = ours.new_cache(ids_BS.shape[1])
    assert all(isinstance(layer, WindowLayerCache) for layer in cache.layers)  # the ring is what is tested
    with torch.no_grad():
        got = [ours.decode(piece_BS, cache) for piece_BS in ids_BS.split(PIECES, dim=1)]
    for i, (got_BSV, want_BSV) in enumerate(zip(got, _hf_decoded(hf, ids_BS), strict=True)):
        assert_rel_close(got_BSV, want_BSV, 1e-5, f"piece {i} of {PIECES[i]} positions")


def test_transformers_window_is_the_one_tested(models):
    """The reference itself sees only the window: its logits past W differ from a full-attention
    twin's (else the test above could not tell a ring that kept everything)."""
    hf, _ = models
    full = hf_model_of(mixtral(sliding_window=None, max_position_embeddings=64), seed=3)
    ids_BS = _ids()
    with torch.no_grad():
        windowed_BSV, full_BSV = hf(ids_BS).logits, full(ids_BS).logits
    torch.testing.assert_close(windowed_BSV[:, :WINDOW], full_BSV[:, :WINDOW])
    assert not torch.allclose(windowed_BSV[:, WINDOW:], full_BSV[:, WINDOW:], rtol=1e-3, atol=1e-3)
