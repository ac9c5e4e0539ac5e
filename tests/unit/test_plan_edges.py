"""Edges of the memory planner (plan/) found against the real model: layouts and options whose
saved activations the plan must follow, each measured on gloo ranks on the CPU (plan.measure, a
DTensor by its local shard) and compared category by category."""


import pytest
from test_parallel_dims import results_on_ranks

from moefold.config import load_config
from moefold.parallel.dims import ParallelDims, ParallelLayout
from moefold.plan import predict_memory
from moefold.plan.measure import measure_saved_activations

EP = 2
# force_balanced: round-robin routing, the balanced share the plan assumes for the all-to-all
ALL_TO_ALL_CASES = {
    "alltoall": ("tiny-qwen3", {}),
    "alltoall-padded": ("tiny-qwen3", {"moe.pad_multiple": 16}),
    "alltoall-padded-combine": ("tiny-qwen3", {"moe.pad_multiple": 16, "moe.memory_efficient_permute": False}),
    "alltoall-deepseek": ("tiny-deepseek", {}),
}
EP_CASES = {
    **ALL_TO_ALL_CASES,
    "allgather": ("tiny-qwen3", {"parallel.ep_dispatcher": "allgather"}),
    "allgather-padded-combine": ("tiny-qwen3", {"parallel.ep_dispatcher": "allgather", "moe.pad_multiple": 16,
                                                "moe.memory_efficient_permute": False}),
    "allgather-combine": ("tiny-deepseek", {"parallel.ep_dispatcher": "allgather",
                                            "moe.memory_efficient_permute": False}),
}


def _ep_config(name: str):
    preset, overrides = EP_CASES[name]
    return load_config(preset, {**overrides, "train.micro_batch_size": 2, "precision.compute_dtype": "fp32",
                                "optim.master_dtype": "fp32", "parallel.ep": EP, "moe.force_balanced": True})


def _measure_ep(rank: int) -> dict:
    layout = ParallelLayout(ParallelDims(EP, ep=EP))
    return {name: measure_saved_activations(_ep_config(name), "fp32", layout=layout).by_category
            for name in EP_CASES}


@pytest.fixture(scope="module")
def measured_ep(tmp_path_factory):
    return results_on_ranks(_measure_ep, EP, tmp_path_factory.mktemp("saved_ep"))


@pytest.mark.parametrize("name", [name for name in EP_CASES if name.startswith("allgather")])
def test_allgather_dispatch_keeps_every_gathered_copy(measured_ep, name):
    """parallel.ep_dispatcher = "allgather" lays out a static expert buffer of every copy the EP
    group gathered, M = ep·T·K rows (AllGatherDispatcher), and its maps are over those M copies:
    the plan counted the all-to-all's balanced T·K rows and the local permutation's maps
    (tiny-qwen3, fp32, ep 2: experts 659,488 B planned, 1,318,944 B kept; moe_dispatch 18,442 B
    planned, 53,256 B kept)."""
    planned = {k: v for k, v in predict_memory(_ep_config(name), EP).activations.items() if v}
    for rank in measured_ep:
        assert planned == rank[name]
    imbalanced = predict_memory(_ep_config(name), EP, imbalance=2.0).activations
    assert imbalanced == predict_memory(_ep_config(name), EP).activations  # static: routing changes nothing


@pytest.mark.parametrize("name", ALL_TO_ALL_CASES)
def test_all_to_all_dispatch_keeps_its_own_maps(measured_ep, name):
    """The all-to-all dispatcher (ep·etp > 1, not padded to capacity) keeps other maps than the
    local permutation: each copy's place in the sorted order and the probabilities' gather index
    ([N] each), combine's [N + 1] rows and mask, and the received rows' regrouping both ways (or,
    padded, their [R + 1] rows and mask and the [Y] groups' indices and mask). The plan counted
    the local permutation's [N] rows, [N] keep mask and [R] rows and mask (tiny-qwen3, fp32, ep 2:
    moe_dispatch 18,442 B planned, 42,010 B kept; padded to 16 rows, 19,522 B and 54,310 B)."""
    planned = {k: v for k, v in predict_memory(_ep_config(name), EP).activations.items() if v}
    for rank in measured_ep:
        assert planned == rank[name]


@pytest.mark.parametrize("layout", [{"parallel.ep": 8}, {"parallel.tp": 2, "parallel.ep": 4, "parallel.sequence_parallel": False}])
def test_backward_gradients_are_each_layer_s_own_shard(layout):
    """Backward makes each layer's gradients in its own layout's share (ddp: experts over ep,
    attention over tp, the rest whole), so at the bottom layer a rank holds every gradient but the
    embedding's: the real parameters' bytes, counted on the built model. The plan gave each layer
    and the head the rank's average bytes per parameter, which the replicated embedding inflates
    (tiny-qwen3 at dim 128, ep 8: 2,228,418 B planned, 2,119,168 B real)."""
    import torch

    from moefold.models.transformer import build_model
    from moefold.parallel.data import expert_parameters

    cfg = load_config("tiny-qwen3", {**layout, "parallel.data_parallel": "ddp", "memory.recompute": '["layer"]',
                                     "model.n_layers": 4, "model.dim": 128, "moe.expert_hidden": 256,
                                     "train.micro_batch_size": 1, "train.seq_len": 64})
    with torch.device("meta"):
        model = build_model(cfg, 257)
    experts = {id(p) for p in expert_parameters(model)}
    tp_sharded = {id(p) for block in model.layers for p in block.attn.parameters() if p.dim() == 2}
    tp_sharded |= {id(p) for block in model.layers for p in block.ffn.parameters() if p.dim() == 2} - experts
    tp_sharded -= {id(block.ffn.router.weight) for block in model.layers if hasattr(block.ffn, "router")}
    p_ = cfg.parallel
    share = {id(p): p.numel() * 4 / (p_.ep if id(p) in experts else p_.tp if id(p) in tp_sharded else 1)
             for p in model.parameters()}
    embedding = sum(share[id(p)] for p in model.tok_embeddings.parameters())
    plan = predict_memory(cfg, 8)
    assert plan.gradients == sum(share.values())
    assert plan.phases["backward"]["gradients"] == sum(share.values()) - embedding  # the bottom layer's step
