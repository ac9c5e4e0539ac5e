"""Expert-load statistics against hand-computed values and a naive reference."""

import math

import pytest
import torch

from moefold.moe.stats import ExpertLoadStats, summarize

LN2, LN4 = math.log(2), math.log(4)
UNIFORM_4 = [0.25, 0.25, 0.25, 0.25]


def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def record(stats, counts, scores, dropped, aux, valid=None):
    stats.record(t(counts, torch.int64), t(scores), t(dropped, torch.int64),
                 {name: t(v) for name, v in aux.items()}, None if valid is None else t(valid, torch.bool))


def two_layer_window() -> list[dict[str, torch.Tensor]]:
    """E = 4. Layer 0 has two forwards, the second with a padding row; layer 1 one forward."""
    layer0, layer1 = ExpertLoadStats(4), ExpertLoadStats(4)
    record(layer0, [3, 1, 0, 0], [UNIFORM_4, UNIFORM_4], 1, {"aux_loss": 1.2})
    record(layer0, [1, 1, 0, 2], [[1, 0, 0, 0], [0, 0, 0, 1], UNIFORM_4], 0,
           {"aux_loss": 1.0, "z_loss": 0.5}, valid=[True, True, False])
    record(layer1, [2, 2, 2, 2], [[0.5, 0.5, 0, 0]] * 3, 2, {"aux_loss": 0.9, "z_loss": 0.3})
    return [layer0.pop(), layer1.pop()]


def test_summarize_two_layers_by_hand():
    m = summarize(two_layer_window())
    # Layer 0: counts [4, 2, 0, 2], total 8, mean 2 → imbalance 4/2 = 2;
    #   deviations [2, 0, -2, 0], population variance 8/4 = 2 → CV √2/2; dead 1/4;
    #   entropy: two uniform rows (ln 4 each) + two one-hot rows (0); the padding row is excluded
    #   → 2·ln 4 / 4 = ln 2; aux_loss (1.2 + 1.0)/2 = 1.1 over its 2 forwards, z_loss 0.5 over 1.
    # Layer 1: counts [2, 2, 2, 2] → imbalance 1, CV 0, dead 0; rows [½, ½, 0, 0] → ln 2;
    #   aux_loss 0.9, z_loss 0.3.
    # Over layers: imbalance (2 + 1)/2 = 1.5, max 2; CV √2/4; dead 1/8; entropy ln 2;
    #   dropped (1 + 0 + 2) / (8 + 8) = 3/16; aux_loss (1.1 + 0.9)/2 = 1.0; z_loss (0.5 + 0.3)/2 = 0.4.
    expected = {"load_imbalance": 1.5, "load_imbalance_max": 2.0, "load_cv": math.sqrt(2) / 4,
                "dead_expert_fraction": 0.125, "routing_entropy": LN2, "dropped_fraction": 3 / 16,
                "aux_loss": 1.0, "z_loss": 0.4}
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, rel=1e-6), key
    assert m["load_imbalance_per_layer"] == pytest.approx([2.0, 1.0])
    assert m["aux_loss_per_layer"] == pytest.approx([1.1, 0.9])
    assert m["z_loss_per_layer"] == pytest.approx([0.5, 0.3])
    assert m["tokens_per_expert_per_layer"] == [[4, 2, 0, 2], [2, 2, 2, 2]]
    assert all(type(c) is int for c in m["tokens_per_expert_per_layer"][0])


@pytest.mark.parametrize("num_experts", [2, 8, 64])
def test_entropy_uniform_is_ln_e_and_one_hot_is_zero(num_experts):
    uniform, one_hot = ExpertLoadStats(num_experts), ExpertLoadStats(num_experts)
    counts_E = torch.ones(num_experts, dtype=torch.int64)
    uniform.record(counts_E, torch.full((5, num_experts), 1 / num_experts), torch.tensor(0), {})
    one_hot.record(counts_E, torch.eye(num_experts)[torch.arange(5) % num_experts], torch.tensor(0), {})
    m = summarize([uniform.pop(), one_hot.pop()])
    assert m["routing_entropy"] == pytest.approx(math.log(num_experts) / 2, rel=1e-6)


def test_aux_name_missing_from_a_layer_is_averaged_over_the_layers_that_have_it():
    with_z, without_z = ExpertLoadStats(2), ExpertLoadStats(2)
    record(with_z, [1, 1], [[0.5, 0.5]], 0, {"aux_loss": 1.0, "z_loss": 2.0})
    record(without_z, [1, 1], [[0.5, 0.5]], 0, {"aux_loss": 3.0})
    m = summarize([with_z.pop(), without_z.pop()])
    assert m["aux_loss"] == 2.0 and m["z_loss"] == 2.0
    assert m["z_loss_per_layer"][0] == 2.0 and math.isnan(m["z_loss_per_layer"][1])
    # Popped but not reported in the next window: the name drops out instead of showing nan.
    record(with_z, [1, 1], [[0.5, 0.5]], 0, {"aux_loss": 1.0})
    assert "z_loss" not in summarize([with_z.pop()])


def test_summarize_matches_naive_reference_on_random_routing():
    gen = torch.Generator().manual_seed(0)
    E, calls = 6, 3
    stats = ExpertLoadStats(E)
    counts, scores, valid, aux = [], [], [], []
    for _ in range(calls):
        counts.append(torch.randint(0, 9, (E,), generator=gen))
        scores.append(torch.randn(7, E, generator=gen).softmax(-1))
        valid.append(torch.rand(7, generator=gen) > 0.3)
        aux.append(torch.rand((), generator=gen))
        stats.record(counts[-1], scores[-1], torch.tensor(1), {"aux_loss": aux[-1]}, valid[-1])
    m = summarize([stats.pop()])
    counts_E = torch.stack(counts).sum(0).double()
    probs_TE, valid_T = torch.cat(scores).double(), torch.cat(valid)
    entropy_T = -(probs_TE * probs_TE.log()).sum(-1)
    assert m["load_imbalance"] == pytest.approx(float(counts_E.max() / counts_E.mean()))
    assert m["load_cv"] == pytest.approx(float(counts_E.std(unbiased=False) / counts_E.mean()))
    assert m["dead_expert_fraction"] == pytest.approx(float((counts_E == 0).double().mean()))
    assert m["routing_entropy"] == pytest.approx(float(entropy_T[valid_T].mean()), rel=1e-5)
    assert m["dropped_fraction"] == pytest.approx(calls / float(counts_E.sum()))
    assert m["aux_loss"] == pytest.approx(float(torch.stack(aux).mean()))


def test_pop_returns_the_window_and_resets():
    stats = ExpertLoadStats(4)
    record(stats, [1, 2, 3, 4], [UNIFORM_4], 1, {"aux_loss": 1.0})
    first = stats.pop()
    assert first["tokens_per_expert_E"].tolist() == [1, 2, 3, 4]
    second = stats.pop()
    assert all(not v.any() for v in second.values())
    assert second.keys() == first.keys()


def test_frozen_restores_the_accumulators():
    stats = ExpertLoadStats(4)
    record(stats, [1, 2, 3, 4], [UNIFORM_4], 1, {"aux_loss": 1.0})
    before = {k: v.clone() for k, v in stats._raw().items()}
    with stats.frozen():
        record(stats, [9, 9, 9, 9], [[1, 0, 0, 0]], 5, {"aux_loss": 7.0, "z_loss": 3.0})
    after = stats.pop()
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    assert after["aux_calls/z_loss"] == 0  # first seen inside the block: back to zero


def test_no_forward_gives_nan_ratios_not_an_exception():
    m = summarize([ExpertLoadStats(4).pop(), ExpertLoadStats(4).pop()])
    for key in ("load_imbalance", "load_imbalance_max", "load_cv", "dead_expert_fraction",
                "routing_entropy", "dropped_fraction"):
        assert math.isnan(m[key]), key
    assert m["tokens_per_expert_per_layer"] == [[0] * 4, [0] * 4]
    assert summarize([]) == {}


def test_one_idle_layer_makes_the_means_nan_but_not_the_other_layers():
    busy = ExpertLoadStats(2)
    record(busy, [3, 1], [[0.5, 0.5]], 0, {})
    m = summarize([busy.pop(), ExpertLoadStats(2).pop()])
    assert m["load_imbalance_per_layer"][0] == 1.5 and math.isnan(m["load_imbalance_per_layer"][1])
    assert math.isnan(m["load_imbalance"]) and math.isnan(m["load_imbalance_max"])
    assert m["dropped_fraction"] == 0.0


def test_summarize_moves_to_the_host_once(monkeypatch):
    calls = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: calls.append(1) or original(self))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("item() is a second sync"))
    summarize(two_layer_window())
    assert len(calls) == 1


def test_casting_the_model_keeps_the_sums_in_fp32():
    stats = ExpertLoadStats(4, aux_names=("aux_loss",)).to(torch.bfloat16)
    assert stats.entropy_sum.dtype == torch.float32 and stats.aux_sum_aux_loss.dtype == torch.float32
    assert stats.tokens_E.dtype == torch.int64


def test_buffers_are_not_checkpointed():
    stats = ExpertLoadStats(4, aux_names=("aux_loss",))
    assert stats.state_dict() == {}
    with pytest.raises(ValueError, match="load_imbalance"):
        ExpertLoadStats(4, aux_names=("load_imbalance",))


@pytest.mark.gpu
def test_record_and_pop_do_not_sync_and_summarize_syncs_once():
    stats = ExpertLoadStats(8, aux_names=("aux_loss",)).cuda()
    counts_E = torch.randint(0, 5, (8,), device="cuda")
    scores_TE = torch.randn(32, 8, device="cuda").softmax(-1)
    valid_T = torch.rand(32, device="cuda") > 0.2
    aux = {"aux_loss": torch.rand((), device="cuda")}
    zero, one = torch.tensor(0, device="cuda"), torch.tensor(1, device="cuda")  # H2D copies sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        stats.record(counts_E, scores_TE, zero, aux, valid_T)
        stats.record(counts_E, scores_TE, one, aux)
        raw = stats.pop()
        with stats.frozen():
            stats.record(counts_E, scores_TE, zero, aux)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    m = summarize([raw])
    assert m["tokens_per_expert_per_layer"][0] == (2 * counts_E).tolist()
