"""Generation's KV cache (`Transformer.decode`, models/kv_cache.py) against the model's own full
forward: every position's logits, read as a prompt and then in pieces of 1–4 tokens, for GQA with
QK-norm (tiny-qwen3), MLA with YaRN and q-LoRA (tiny-deepseek) and a sliding window shorter than
the sequence (tiny-mixtral), in fp64; and `sample` against sampling by full forwards of the
latest `context` tokens (the way generation worked before the cache), past the context too; a
run trained with a capacity factor generates dropless."""

import pytest
import torch

from moefold.cli import main
from moefold.config import load_config
from moefold.errors import UserError
from moefold.generate import _pick, load_model_from_run, sample
from moefold.models.attention import SlidingWindowMask, causal_mask
from moefold.models.kv_cache import KVCache
from moefold.models.transformer import build_model

PRESETS = {"tiny-qwen3": {}, "tiny-deepseek": {}, "tiny-mixtral": {"model.sliding_window": "5"}}


def _model(preset: str, overrides: dict[str, str] | None = None):
    """`overrides`: PRESETS' for the preset by default ({}: the preset as shipped)."""
    # all in fp64: grouped_mm has no fp64 kernel, and an fp32 router would round differently by shape
    overrides = PRESETS[preset] if overrides is None else overrides
    cfg = load_config(preset, {**overrides, "moe.experts_backend": "loop", "moe.router_dtype": "fp64"})
    model = build_model(cfg, 97).double().eval()
    model.init_weights(0)
    with torch.no_grad():  # expert bias and norms off their defaults, so a misplaced one shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    return model


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_decoding_in_pieces_gives_the_full_forward_s_logits(preset):
    model = _model(preset)
    ids_BS = torch.randint(0, 97, (2, 23), generator=torch.Generator().manual_seed(1))
    full_BSV = model(ids_BS)
    cache = model.new_cache(23)
    pieces = [7, 1, 1, 3, 1, 4, 2, 1, 1, 2]  # a prompt, then single tokens and short runs
    start = 0
    for n in pieces:
        got_BSV = model.decode(ids_BS[:, start:start + n], cache)
        torch.testing.assert_close(got_BSV, full_BSV[:, start:start + n], rtol=1e-9, atol=1e-10,
                                   msg=lambda m, start=start, n=n: f"{preset}, positions {start}..{start + n - 1}: {m}")
        start += n
    assert cache.length == start == 23
    with pytest.raises(ValueError, match="KV cache of 23 positions cannot take 1 more after 23"):
        model.decode(ids_BS[:, :1], cache)


def _sample_by_full_forwards(model, prompt_ids, max_new_tokens, temperature, top_k, context, eos_id, generator):
    """Sampling as it was without a cache: each token from a full forward of the latest `context`."""
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        logits_V = model(torch.tensor([ids[-context:]]))[0, -1].float()
        next_id = _pick(logits_V, temperature, top_k, generator)
        if next_id == eos_id:
            break
        ids.append(next_id)
    return ids[len(prompt_ids):]


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("temperature, top_k", [(0.0, 0), (1.0, 10)], ids=["greedy", "sampled"])
def test_sampling_with_the_cache_picks_what_full_forwards_pick(preset, temperature, top_k):
    model = _model(preset)
    prompt = [5, 17, 3, 42, 8]
    context = 9  # the 25 new tokens run past it: the window moves, read anew each token
    got = sample(model, prompt, 25, temperature, top_k, context, -1, torch.Generator().manual_seed(3))
    want = _sample_by_full_forwards(model, prompt, 25, temperature, top_k, context, -1,
                                    torch.Generator().manual_seed(3))
    assert got == want and len(got) == 25
    long_prompt = list(range(1, 14))  # longer than the context: refused, not cut (as transformers)
    with pytest.raises(UserError, match="^sample: prompt_ids holds 13 tokens, more than context 9$"):
        sample(model, long_prompt, 4, 0.0, 0, context, -1, torch.Generator())


def test_a_run_trained_with_a_capacity_factor_generates_dropless(tmp_path, tiny_args):
    """With capacity, a token's output depends on what else the forward reads (the prompt, a
    decode call); generation's model keeps every token, so a prefix reads as in the longer input."""
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "2", "--train.warmup_steps", "1",
                 "--moe.capacity_factor", "0.5", "--moe.pad_to_capacity", "true"]) == 0
    model, _, cfg = load_model_from_run(run, "cpu")
    assert cfg.moe.capacity_factor == 0.5  # the run's config, as trained
    ids_BS = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full_BSV, prefix_BSV = model(ids_BS), model(ids_BS[:, :6])
        cache = model.new_cache(24)
        model.decode(ids_BS[:, :20], cache)
        last_BSV = model.decode(ids_BS[:, 20:21], cache)
    torch.testing.assert_close(prefix_BSV, full_BSV[:, :6], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(last_BSV, full_BSV[:, 20:21], rtol=1e-4, atol=1e-5)


def test_attention_mask_of_new_queries_over_cached_keys():
    assert causal_mask(0, 4, "cpu") == {"is_causal": True}
    assert causal_mask(6, 1, "cpu") == {}
    allowed = causal_mask(2, 3, "cpu")["attn_mask"]  # queries 2, 3, 4 over keys 0..4
    assert allowed.tolist() == [[True, True, True, False, False], [True, True, True, True, False],
                                [True, True, True, True, True]]
    windowed = SlidingWindowMask(2)(3, 1, "cpu")["attn_mask"]  # query 3 sees keys 2 and 3
    assert windowed.tolist() == [[False, False, True, True]]
    assert KVCache(2, 8).length == 0


def test_rows_beyond_the_tokenizers_vocabulary_are_never_sampled():
    """model.vocab_size padded beyond the tokenizer: those rows are no tokens; sampling among all
    rows at a high temperature would pick them (and decode would drop them silently)."""
    model = _model(sorted(PRESETS)[0])
    vocab = model.vocab_size // 4
    got = sample(model, [1, 2, 3], 40, 50.0, 0, 9, -1, torch.Generator().manual_seed(0), vocab)
    assert len(got) == 40 and max(got) < vocab
    anywhere = sample(model, [1, 2, 3], 40, 50.0, 0, 9, -1, torch.Generator().manual_seed(0))
    assert max(anywhere) >= vocab  # the check above can fail


def test_the_printed_text_keeps_the_space_a_word_start_token_carries(tmp_path):
    """SentencePiece-style tokenizers (a word's space in its token, ▁) drop the leading space of a
    first token decoded alone: the continuation is decoded with the prompt's ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from moefold.data.tokenizer import HFTokenizer
    from moefold.generate import continuation

    vocab = {"<unk>": 0, "</s>": 1, "▁the": 2, "▁quick": 3, "▁brown": 4, "▁fox": 5}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.add_special_tokens(["</s>"])
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    ours = HFTokenizer(str(path))
    prompt_ids = ours.encode("the quick")
    assert prompt_ids == [2, 3]
    assert ours.decode([4, 5]) == "brown fox"  # alone: the space is gone
    assert continuation(ours, "the quick", prompt_ids, [4, 5]) == "the quick brown fox"


@pytest.mark.parametrize("temperature", [1e-38, 5e-324, 1e-30])
def test_a_tiny_temperature_picks_the_most_likely_token(temperature):
    """Logits divided by 1e-38 overflowed to inf and the softmax to nan (a multinomial error)."""
    logits_V = torch.randn(300, generator=torch.Generator().manual_seed(0)) * 30
    assert _pick(logits_V, temperature, 0, torch.Generator().manual_seed(1)) == int(logits_V.argmax())


def test_top_k_restricts_sampling_at_any_temperature():
    """Top-k is applied before the temperature: at an infinite one every logit became 0, the kth
    largest tied with all, and sampling ran over the whole vocabulary."""
    logits_V = torch.arange(300, dtype=torch.float32)
    picks = {_pick(logits_V, float("inf"), 3, torch.Generator().manual_seed(s)) for s in range(50)}
    assert picks == {297, 298, 299}


def test_sampling_from_an_empty_prompt_is_refused_naming_the_argument():
    """`moefold generate` refuses a prompt of no tokens; from Python, `sample(model, [])` failed in
    the embedding (float indices: torch.tensor([[]]) is fp32)."""
    model = _model(sorted(PRESETS)[0])
    with pytest.raises(UserError, match="prompt_ids is empty"):
        sample(model, [], 4, 0.0, 0, 9, -1, torch.Generator())


def test_a_batch_other_than_the_cached_one_is_refused():
    """A cache that read 2 sequences took a decode of 1 silently: the slice assignment broadcast
    its keys and values into both rows, and the second sequence's logits continued the first's
    token. Now a ValueError names both batch sizes, and the cache is left as it was."""
    model = _model("tiny-qwen3")
    ids_BS = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache(8)
    model.decode(ids_BS[:, :5], cache)
    with pytest.raises(ValueError, match="KV cache of 2 sequences cannot take a batch of 1"):
        model.decode(ids_BS[:1, 5:], cache)
    assert cache.length == 5
    torch.testing.assert_close(model.decode(ids_BS[:, 5:], cache), model(ids_BS)[:, 5:], rtol=1e-9, atol=1e-10)
