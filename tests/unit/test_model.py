"""The transformer's parts against naive references, and the FLOP convention on a hand-counted model."""

import copy
import math

import pytest
import torch

from moefold.config import load_config
from moefold.models.attention import Attention, SlidingWindowMask, causal_mask
from moefold.models.rope import apply_rope, rope_cos_sin
from moefold.models.transformer import build_model, is_moe_layer, materialize
from moefold.moe.layer import MoELayer
from moefold.train.flops import count_params, train_flops_per_token
from moefold.train.metrics import throughput


def naive_attention(attn: Attention, x_BSD, cos, sin):
    B, S, _ = x_BSD.shape
    H, G, Dh = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = attn.q_norm(attn.wq(x_BSD).view(B, S, H, Dh)).transpose(1, 2)
    k = attn.k_norm(attn.wk(x_BSD).view(B, S, G, Dh)).transpose(1, 2)
    v = attn.wv(x_BSD).view(B, S, G, Dh).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(Dh)
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    out = scores.softmax(-1) @ v
    return attn.wo(out.transpose(1, 2).reshape(B, S, H * Dh))


@pytest.mark.parametrize("qk_norm", [True, False])
def test_gqa_attention_matches_naive(qk_norm):
    torch.manual_seed(0)
    attn = Attention(dim=32, n_heads=4, n_kv_heads=2, head_dim=8, qk_norm=qk_norm, norm_eps=1e-6)
    x = torch.randn(2, 10, 32)
    cos, sin = rope_cos_sin(10, 8, 10000.0)
    torch.testing.assert_close(attn(x, cos, sin), naive_attention(attn, x, cos, sin))


def test_rope_scores_depend_only_on_relative_position():
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    cos, sin = rope_cos_sin(40, 16, 10000.0)

    def score(i, j):
        qi = apply_rope(q.expand(1, 1, 40, 16), cos, sin)[0, 0, i]
        kj = apply_rope(k.expand(1, 1, 40, 16), cos, sin)[0, 0, j]
        return (qi @ kj).item()

    assert score(5, 2) == pytest.approx(score(30, 27), rel=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 4), rel=1e-3)


def test_model_is_causal_and_layer_pattern_follows_config():
    cfg = load_config("tiny", {"model.n_layers": "6", "moe.first_k_dense": "2", "moe.moe_every": "2"})
    assert [is_moe_layer(cfg, i) for i in range(6)] == [False, False, True, False, True, False]
    model = build_model(cfg, vocab_size=257)
    model.init_weights(seed=0)
    assert [isinstance(b.ffn, MoELayer) for b in model.layers] == [False, False, True, False, True, False]
    ids = torch.randint(0, 257, (2, 16))
    changed = ids.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 257
    logits, logits_changed = model(ids), model(changed)
    assert logits.shape == (2, 16, 257)
    torch.testing.assert_close(logits[:, :10], logits_changed[:, :10])
    assert not torch.allclose(logits[:, 10:], logits_changed[:, 10:])


@pytest.mark.parametrize("no_moe", [{"moe.num_experts": "0"}, {"moe.first_k_dense": "4"}])
def test_a_config_without_moe_layers_builds_a_dense_transformer(no_moe):
    """moe.num_experts = 0 (or every layer dense) is a dense baseline: nothing routes or replays."""
    model = build_model(load_config("tiny", no_moe), vocab_size=257)
    model.init_weights(seed=0)
    assert not any(isinstance(b.ffn, MoELayer) for b in model.layers)
    assert model.router_replay is None
    counts = count_params(model)
    assert counts.active == counts.total - counts.embedding  # every weight but the lookup table computes
    model(torch.randint(0, 257, (2, 16))).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("preset, overrides", [
    ("tiny", {}), ("tiny", {"model.tie_embeddings": "true"}), ("tiny-deepseek", {}),  # MTP, expert bias
])
def test_built_on_meta_then_materialized_equals_built_in_place(preset, overrides):
    """How the trainer builds (no host copy) against building on the CPU: same weights, buffers,
    ties and outputs for the same seed."""
    cfg = load_config(preset, overrides)
    in_place = build_model(cfg, vocab_size=257)
    in_place.init_weights(seed=3)
    with torch.device("meta"):
        lazy = build_model(cfg, vocab_size=257)
    materialize(lazy, torch.device("cpu"))
    lazy.init_weights(seed=3)
    expected, got = in_place.state_dict(), lazy.state_dict()
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    assert (lazy.output.weight is lazy.tok_embeddings.weight) == (overrides != {})
    assert all(not b.is_meta for b in lazy.buffers()) and all(not p.is_meta for p in lazy.parameters())
    ids = torch.randint(0, 257, (2, 16))
    torch.testing.assert_close(lazy(ids), in_place(ids), rtol=0, atol=0)


def test_tied_head_shares_the_embedding():
    model = build_model(load_config("tiny", {"model.tie_embeddings": "true"}), vocab_size=257)
    assert model.output.weight is model.tok_embeddings.weight


HAND_CFG = {"model.dim": "32", "model.n_layers": "2", "model.n_heads": "2", "model.n_kv_heads": "1",
            "model.ffn_hidden": "64", "moe.num_experts": "4", "moe.top_k": "2",
            "moe.expert_hidden": "32", "moe.first_k_dense": "1"}


@pytest.mark.parametrize("tied", [False, True])
def test_param_counts_and_flops_hand_checked(tied):
    model = build_model(load_config("tiny", {**HAND_CFG, "model.tie_embeddings": str(tied)}), 257)
    attn = 32 * 32 + 32 * 16 + 32 * 16 + 32 * 32 + 16 + 16  # q, k, v, o, q/k norms (head dim 16)
    norms = 2 * 32
    dense_mlp = 3 * 32 * 64
    router, experts = 4 * 32, 3 * 4 * 32 * 32
    head = embedding = 257 * 32
    body = (attn + norms + dense_mlp) + (attn + norms + router + experts) + 32
    counts = count_params(model)
    assert counts.total == body + head + (0 if tied else embedding)
    assert counts.active == body - experts + experts * 2 // 4 + head
    # 6·active + causal attention 3 · L · S · H · (Dh + Dh)
    assert train_flops_per_token(model, seq_len=64) == 6 * counts.active + 3 * 2 * 64 * 2 * (16 + 16)


def test_throughput_and_mfu_hand_checked():
    m = throughput(tokens=1000, seconds=2.0, flops_per_token=3_000_000_000, peak_tflops=10.0)
    assert m["tokens_per_s"] == 500 and m["tflops"] == pytest.approx(1.5) and m["mfu"] == pytest.approx(0.15)
    assert throughput(1000, 2.0, 3, None)["mfu"] is None


def test_sliding_window_attention_matches_naive_band_mask():
    torch.manual_seed(0)
    attn = Attention(dim=32, n_heads=4, n_kv_heads=2, head_dim=8, qk_norm=False, norm_eps=1e-6,
                     sliding_window=3)
    x = torch.randn(2, 10, 32)
    cos, sin = rope_cos_sin(10, 8, 10000.0)
    out = attn(x, cos, sin)
    # token i sees tokens i-2..i: changing token 5 leaves outputs 0-4 and 8-9 unchanged
    x2 = x.clone()
    x2[:, 5] += 1.0
    diff = (attn(x2, cos, sin) - out).abs().amax(dim=(0, 2))
    assert (diff[:5] == 0).all() and (diff[8:] == 0).all() and (diff[5:8] > 0).all()


@pytest.mark.parametrize("window", [10, 11, 4096])
def test_a_window_covering_the_sequence_is_plain_causal_attention(window):
    """A window at least as long as the sequence masks nothing causal attention does not: SDPA
    gets is_causal (its fused kernels mask themselves) instead of an [S, S] mask, and the output
    is the windowless model's. In generation the same holds while start + new tokens fit."""
    torch.manual_seed(0)
    windowed = Attention(dim=32, n_heads=4, n_kv_heads=2, head_dim=8, qk_norm=False, norm_eps=1e-6,
                         sliding_window=window)
    causal = copy.deepcopy(windowed)
    causal.mask = causal_mask
    assert windowed.mask(0, 10, "cpu") == {"is_causal": True}
    x = torch.randn(2, 10, 32)
    cos, sin = rope_cos_sin(10, 8, 10000.0)
    torch.testing.assert_close(windowed(x, cos, sin), causal(x, cos, sin), rtol=0, atol=0)
    assert torch.equal(windowed.mask(6, 4, "cpu")["attn_mask"], causal_mask(6, 4, "cpu")["attn_mask"])
    band = SlidingWindowMask(9)(0, 10, "cpu")["attn_mask"]  # one short of the sequence: a band
    assert not band[9, 0] and band[9, 1] and band[8, 0]


def test_mtp_loss_is_the_shifted_prediction_of_each_depth():
    import torch.nn.functional as F

    from moefold.train.loss import NextTokenAndMTPLoss

    cfg = load_config("tiny-deepseek", {"model.mtp_layers": "2"})
    model = build_model(cfg, vocab_size=50)
    model.init_weights(seed=0)
    ids = torch.randint(0, 50, (2, 12))
    labels = torch.randint(0, 50, (2, 12))
    total, parts = NextTokenAndMTPLoss(weight=0.5)(model, ids, labels)

    h, (cos, sin) = model.trunk(ids)
    manual = []
    for k, module in enumerate(model.mtp.layers, start=1):
        emb = model.tok_embeddings(ids[:, k:])  # position i sees token i+k ...
        h = module(h[:, :12 - k], emb, cos[:12 - k], sin[:12 - k])
        logits = model.output(module.norm(h))
        manual.append(F.cross_entropy(logits.flatten(0, 1), labels[:, k:].flatten()))  # ... predicts i+k+1
    lm = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten())
    torch.testing.assert_close(parts["mtp_loss"], torch.stack(manual).mean())
    torch.testing.assert_close(total, lm + 0.5 * torch.stack(manual).mean())



@pytest.mark.parametrize("seq_len", [1, 2])
def test_an_mtp_depth_without_targets_adds_zero_to_the_mtp_loss(seq_len):
    """Depth k predicts the token k further on than the main head: sequences of S ≤ k tokens leave
    it no target. S = k gave a nan loss (a mean over no tokens) and S < k a shape error; such a
    depth adds 0 (Megatron-Core clamps its token count to 1), a depth with targets keeps its loss,
    and every gradient is finite."""
    import torch.nn.functional as F

    from moefold.train.loss import LogitsLoss, NextTokenAndMTPLoss

    cfg = load_config("tiny-deepseek", {"model.n_layers": "1", "model.mtp_layers": "2"})
    model = build_model(cfg, vocab_size=50)
    model.init_weights(seed=0)
    ids, labels = torch.randint(0, 50, (2, seq_len)), torch.randint(0, 50, (2, seq_len))
    total, parts = NextTokenAndMTPLoss(weight=0.5)(model, ids, labels)
    total.backward()
    assert torch.isfinite(total)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)

    h, (cos, sin) = model.trunk(ids)
    depths = model.mtp(h, ids, labels, model.tok_embeddings, model.output, cos, sin, LogitsLoss())
    assert depths[1].item() == 0.0  # depth 2 never has a target here
    if seq_len == 1:
        assert depths[0].item() == 0.0
    else:  # depth 1: position 0 predicts labels[:, 1]
        module = model.mtp.layers[0]
        h1 = module(h[:, :1], model.tok_embeddings(ids[:, 1:]), cos[:1], sin[:1])
        expected = F.cross_entropy(model.output(module.norm(h1)).flatten(0, 1), labels[:, 1])
        torch.testing.assert_close(depths[0], expected)
    torch.testing.assert_close(parts["mtp_loss"], torch.stack(depths).mean())


@pytest.mark.parametrize("no_moe", [False, True])
def test_the_model_reads_an_integer_mask_as_the_bool_one_and_refuses_a_float_one(no_moe):
    """Checked once at the model's entry: a dense model, which routes nothing, refuses a float mask
    too, rather than ignoring it until an MoE layer is added."""
    from moefold.errors import UserError

    cfg = load_config("tiny", {"model.n_layers": "2", **({"moe.num_experts": "0"} if no_moe else {})})
    model = build_model(cfg, vocab_size=50)
    model.init_weights(seed=0)
    ids = torch.randint(0, 50, (2, 8))
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[0, 5:] = False
    torch.testing.assert_close(model(ids, valid.long()), model(ids, valid), rtol=0, atol=0)
    with pytest.raises(UserError, match="valid_BS has dtype torch.float16; allowed: torch.bool"):
        model(ids, valid.half())
