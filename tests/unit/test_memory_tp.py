"""memory.recompute and memory.offload under tensor parallelism (tp 2 on gloo ranks, with and
without sequence parallelism): each rank trains its share of the model with an option and without
it, and the two runs must agree bit for bit, as they do in one process (test_recompute.py,
test_offload.py). Under TP the QK-norms are head-sharded, the sharded linears save DTensors and,
with sequence parallelism, so do the pre-norms; offload moves those DTensors' local shards. What
each option saves is measured against the planner in test_plan_tp.py. Under expert parallelism the
experts read their DTensor weights' shards (`to_local()`): offload must leave those, like any
parameter, on the device."""


import pytest
from memory_runs import assert_identical, build, train
from test_parallel_dims import results_on_ranks
from torch.distributed.tensor import DTensor

from moefold.parallel.dims import ParallelDims, ParallelLayout
from moefold.parallel.local import local_tensor

TP = 2
FINE_GRAINED = '["norm", "attn_core", "mla_up_proj", "moe_act", "shared_experts", "mlp"]'
OPTIONS = {  # qwen3: GQA with QK-norm; deepseek: MLA, a shared expert, a dense layer, MTP
    "qwen3": [("recompute", '["norm"]'), ("offload", '["norm"]'), ("offload", '["layer"]')],
    "deepseek": [("recompute", FINE_GRAINED), ("recompute", '["layer"]'), ("offload", '["layer"]')],
}
CASES = [(config, kind, names, sp) for config, options in OPTIONS.items()
         for kind, names in options for sp in (False, True)]


def _key(config, kind, names, sp) -> str:
    return f"{config} {kind} {names} sp={sp}"


def _build(config: str, sp: bool, layout, **memory: str):
    overrides = {"parallel.tp": str(TP), "parallel.sequence_parallel": str(sp).lower(),
                 **{f"memory.{k}": v for k, v in memory.items()}}
    return build(config, overrides, layout=layout)


class OffloadSpy:
    """Bytes of DTensor shards an offload sent to the host, and how many tensors it sent were a
    parameter's memory (a DTensor parameter's shard included)."""

    def __init__(self, model):
        offload, pack = model.activation_offload, model.activation_offload.pack
        params = {local_tensor(p.detach()).untyped_storage().data_ptr() for p in model.parameters()}
        self.nbytes, self.weights = 0, 0

        def counting(t):
            packed = pack(t)
            if packed is not t:
                local = t._local_tensor if isinstance(t, DTensor) else t
                self.nbytes += local.untyped_storage().nbytes() if isinstance(t, DTensor) else 0
                self.weights += local.untyped_storage().data_ptr() in params
            return packed
        offload.pack = counting  # the sites' hooks look it up on the instance at each call


def _train_all(rank: int) -> dict:
    layout = ParallelLayout(ParallelDims(TP, tp=TP))
    results, plain_runs = {}, {}
    for config, kind, names, sp in CASES:
        if (config, sp) not in plain_runs:
            plain_runs[config, sp] = train(_build(config, sp, layout), steps=2, accum=1)
        plain = plain_runs[config, sp]
        memory = {kind: names, **({"offload_min_bytes": "0"} if kind == "offload" else {})}  # else refused
        model = _build(config, sp, layout, **memory)
        moved = OffloadSpy(model) if kind == "offload" else None
        differs = _difference(train(model, steps=2, accum=1), plain)
        results[_key(config, kind, names, sp)] = {
            "differs": differs, "shard_bytes": moved and moved.nbytes, "weights": moved and moved.weights}
    results["ep"] = _offload_under_ep()
    return results


def _offload_under_ep() -> dict:
    layout = ParallelLayout(ParallelDims(TP, ep=TP))
    ep = {"parallel.ep": str(TP)}
    plain = train(build("qwen3", ep, layout=layout), steps=2, accum=1)
    model = build("qwen3", {**ep, "memory.offload": '["moe"]', "memory.offload_min_bytes": "0"}, layout=layout)
    moved = OffloadSpy(model)
    differs = _difference(train(model, steps=2, accum=1), plain)
    return {"differs": differs, "weights": moved.weights, "offloaded": model.activation_offload.offloaded_bytes}


def _difference(run, plain) -> str:
    """How `run` differs from `plain` ("" when bit-identical), reported to the test from a rank."""
    try:
        assert_identical(run, plain)
    except AssertionError as e:
        return str(e)
    return ""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case on one spawn of 2 ranks (spawning dominates the time on a 2-core machine)."""
    return results_on_ranks(_train_all, TP, tmp_path_factory.mktemp("runs"))


@pytest.mark.parametrize("config,kind,names,sp", CASES, ids=[_key(*c) for c in CASES])
def test_trains_bit_identically_under_tp(results, config, kind, names, sp):
    """Losses, every gradient (this rank's shard), MoE statistics and counts, router replay's
    recording and the RNG stream equal the plain TP run's, on both ranks."""
    for rank in range(TP):
        assert results[rank][_key(config, kind, names, sp)]["differs"] == "", f"rank {rank}"


# Without sequence parallelism the norms see plain tensors; whole layers hold the sharded linears.
SHARDS = [c for c in CASES if c[1] == "offload" and (c[3] or c[2] != '["norm"]')]


@pytest.mark.parametrize("config,kind,names,sp", SHARDS, ids=[_key(*c) for c in SHARDS])
def test_offload_moves_dtensor_shards(results, config, kind, names, sp):
    """The TP-sharded linears' inputs and (sp) the pre-norms' tensors are DTensors: their local
    shards go to the host; parameters' shards stay."""
    for rank in range(TP):
        moved = results[rank][_key(config, kind, names, sp)]
        assert moved["shard_bytes"] > 0 and moved["weights"] == 0, f"rank {rank}: {moved}"


def test_offload_under_ep_leaves_the_expert_weights(results):
    """The experts save `w.to_local()` of their EP-sharded weights, a parameter's memory: offload
    leaves it on the device (it had copied every local expert weight to the host in each forward),
    and training stays bit-identical."""
    for rank in range(TP):
        ep = results[rank]["ep"]
        assert ep["differs"] == "" and ep["weights"] == 0 and ep["offloaded"] > 0, f"rank {rank}: {ep}"
