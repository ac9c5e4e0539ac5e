"""The training objectives on right-padded batches (`objective(model, ids, labels, valid_BS)`)
against the same sequences without padding, written as DeepSeek-V3 writes multi-token prediction:
MTP module k runs on the first L − k positions of a sequence of L tokens (no fill, no mask). Losses,
every MoE layer's statistics and step counts (trunk and MTP blocks), and every gradient (the
injected balance losses' included) agree; the model runs in fp64, so routing cannot flip on
rounding between the padded and the unpadded shapes. A micro-batch of padding alone adds 0."""

import pytest
import torch
import torch.nn.functional as F

from moefold.config import load_config
from moefold.data import IGNORE_INDEX
from moefold.models.transformer import build_model
from moefold.train.loss import ChunkedLoss, NextTokenAndMTPLoss, NextTokenLoss

V, PAD = 61, 7  # the padding's id is a real token's: only the mask tells it apart
MTP_WEIGHT = 0.3


def _model(mtp_layers: int):
    cfg = load_config("tiny-deepseek", {
        "model.n_layers": "2", "model.mtp_layers": str(mtp_layers),  # layer 1 and MTP blocks MoE
        "moe.experts_backend": "loop", "moe.router_dtype": "fp64",
        "moe.aux_loss_coeff": "0.1", "moe.seq_aux_loss_coeff": "0.1", "moe.z_loss_coeff": "0.01"})
    model = build_model(cfg, V).double()
    model.init_weights(0)
    with torch.no_grad():  # norms and expert bias off their defaults, so routing has a bias to use
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    return model


def _objective(kind: str):
    return {"plain": NextTokenLoss(), "chunked": NextTokenLoss(ChunkedLoss(5)),
            "mtp": NextTokenAndMTPLoss(MTP_WEIGHT), "mtp-chunked": NextTokenAndMTPLoss(MTP_WEIGHT, ChunkedLoss(5))}[kind]


def deepseek_v3_reference(model, ids_BL, labels_BL):
    """(lm loss, [depth k's loss]) of unpadded sequences: the trunk over all L tokens, MTP module k
    over positions 0..L−k−1, each reading the embedding of the token k on and predicting label k on."""
    h_BLD, (cos, sin) = model.trunk(ids_BL)
    lm = _cross_entropy(model.output(model.norm(h_BLD)), labels_BL)
    depths, L = [], ids_BL.shape[1]
    for k, module in enumerate(model.mtp.layers if model.mtp is not None else [], start=1):
        h_BLD = module(h_BLD[:, :L - k], model.tok_embeddings(ids_BL[:, k:]), cos[:L - k], sin[:L - k])
        logits = model.output(module.norm(h_BLD))
        depths.append(_cross_entropy(logits, labels_BL[:, k:]))
    return lm, depths


def _cross_entropy(logits_BLV, labels_BL):
    logits = logits_BLV.flatten(0, 1)  # the loss works in fp32, or in fp64 for fp64 logits (83de019)
    return F.cross_entropy(logits if logits.dtype == torch.float64 else logits.float(), labels_BL.flatten())


def _total(lm, depths):
    return lm + MTP_WEIGHT * torch.stack(depths).mean() if depths else lm


def _padded(ids_BL, labels_BL, lengths, S):
    """Sequence b's first lengths[b] tokens, then padding to S: ids PAD, labels IGNORE_INDEX, valid
    False."""
    B = ids_BL.shape[0]
    ids_BS = torch.full((B, S), PAD)
    labels_BS = torch.full((B, S), IGNORE_INDEX)
    valid_BS = torch.zeros(B, S, dtype=torch.bool)
    for b, L in enumerate(lengths):
        ids_BS[b, :L], labels_BS[b, :L], valid_BS[b, :L] = ids_BL[b, :L], labels_BL[b, :L], True
    return ids_BS, labels_BS, valid_BS


def _taken(model) -> dict[str, torch.Tensor]:
    """What the last forward and backward left: each MoE layer's statistics and step counts, each
    parameter's gradient; all reset."""
    got = {}
    for i, layer in enumerate(model.moe_layers()):
        got.update({f"moe{i}.{key}": value for key, value in layer.stats.pop().items()})
        got[f"moe{i}.step_tokens"] = layer.step_tokens_per_expert_E.clone()
        layer.step_tokens_per_expert_E.zero_()
    for name, p in model.named_parameters():
        if p.grad is not None:
            got[name] = p.grad.clone()
    model.zero_grad(set_to_none=True)
    return got


def _tokens(B, L, seed):
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, V, (B, L + 1), generator=gen)
    return seq[:, :-1], seq[:, 1:]


@pytest.mark.parametrize("kind", ["plain", "chunked", "mtp", "mtp-chunked"])
def test_a_padded_batch_trains_as_the_sequences_unpadded(kind):
    """Sequences of L = 10 tokens and 5 of padding: the same losses, MoE statistics (tokens per
    expert, entropy, balance losses) and gradients as the 10 tokens alone. The MTP blocks route
    only the L − k positions module k has in DeepSeek-V3; a depth mask of the tokens alone
    (padding at i, not at i + k) routed the last k real positions against padding's embedding."""
    model = _model(mtp_layers=2 if kind.startswith("mtp") else 0)
    assert len(model.moe_layers()) == (3 if kind.startswith("mtp") else 1)
    ids_BL, labels_BL = _tokens(B=3, L=10, seed=1)
    ids_BS, labels_BS, valid_BS = _padded(ids_BL, labels_BL, [10, 10, 10], S=15)

    total, parts = _objective(kind)(model, ids_BS, labels_BS, valid_BS)
    total.backward()
    padded = _taken(model)
    lm, depths = deepseek_v3_reference(model, ids_BL, labels_BL)
    _total(lm, depths).backward()
    unpadded = _taken(model)

    torch.testing.assert_close(parts["lm_loss"], lm.detach())
    if depths:
        torch.testing.assert_close(parts["mtp_loss"], torch.stack(depths).mean().detach())
    assert padded.keys() == unpadded.keys()
    assert {"moe0.aux_sum/aux_loss", "moe0.aux_sum/seq_aux_loss", "moe0.aux_sum/z_loss"} <= padded.keys()
    for key in padded:
        torch.testing.assert_close(padded[key], unpadded[key], msg=key)


def test_sequences_of_different_lengths_count_and_score_as_each_alone():
    """Lengths 6 and 16 in a batch of 16, the second unpadded (an integer 0/1 mask, as Hugging
    Face's attention_mask): the tokens per expert and routing entropy of every MoE layer are the two
    sequences' sums, and each loss is their token-weighted mean (depth k of a sequence of L tokens
    has L − k targets). The unpadded row's last k positions at depth k read past its end: a mask
    that counted them as real fails here."""
    model = _model(mtp_layers=2)
    lengths = [6, 16]
    ids_BL, labels_BL = _tokens(B=2, L=16, seed=2)
    ids_BS, labels_BS, valid_BS = _padded(ids_BL, labels_BL, lengths, S=16)

    _, parts = NextTokenAndMTPLoss(MTP_WEIGHT)(model, ids_BS, labels_BS, valid_BS.long())
    padded = _taken(model)
    summed, lm_sum, depth_sums = {}, 0.0, [0.0, 0.0]
    for b, L in enumerate(lengths):
        lm, depths = deepseek_v3_reference(model, ids_BL[b:b + 1, :L], labels_BL[b:b + 1, :L])
        lm_sum += lm.detach() * L
        depth_sums = [s + d.detach() * (L - k) for k, (s, d) in enumerate(zip(depth_sums, depths), start=1)]
        for key, value in _taken(model).items():
            summed[key] = summed.get(key, 0) + value

    additive = [key for key in padded if key.split(".")[-1] in
                ("tokens_per_expert_E", "step_tokens", "entropy_sum", "entropy_tokens")]
    assert len(additive) == 4 * len(model.moe_layers())
    for key in additive:
        torch.testing.assert_close(padded[key], summed[key], msg=key)
    torch.testing.assert_close(parts["lm_loss"], lm_sum / sum(lengths))
    depth_means = [s / sum(L - k for L in lengths) for k, s in enumerate(depth_sums, start=1)]
    torch.testing.assert_close(parts["mtp_loss"], torch.stack(depth_means).mean())


@pytest.mark.parametrize("kind", ["plain", "chunked", "mtp", "mtp-chunked"])
def test_a_micro_batch_without_labels_adds_zero_loss_and_zero_gradient(kind):
    """Every label ignored (a micro-batch all padding, or all prompt in fine-tuning): each loss is
    0 and every gradient 0, as Megatron-Core divides the summed loss by max(tokens, 1). The plain
    and MTP objectives' next-token loss was a mean over no tokens, nan (the MTP depths and the
    chunked loss already gave 0); a nan in one micro-batch made the step's gradients nan."""
    model = _model(mtp_layers=2 if kind.startswith("mtp") else 0)
    ids_BS = _tokens(B=2, L=12, seed=3)[0]
    labels_BS = torch.full_like(ids_BS, IGNORE_INDEX)
    valid_BS = torch.zeros_like(ids_BS, dtype=torch.bool)  # no token to balance either
    total, parts = _objective(kind)(model, ids_BS, labels_BS, valid_BS)
    total.backward()
    assert total.item() == 0.0 and all(value.item() == 0.0 for value in parts.values())
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all((grad == 0).all() for grad in grads)
