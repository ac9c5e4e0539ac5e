"""The memory planner's saved activations under tensor parallelism, with and without sequence
parallelism, against the real model's on 2 gloo ranks.

Each rank builds the model, parallelizes it as the trainer does (tp 2) and counts what autograd
keeps for backward, each storage once, a DTensor by its local shard (plan.measure, fp32 for real);
the planner's activations of one micro-batch (predict_memory at tp 2, sp on and off) must agree
with them category by category within 0.1% (to the byte when written), and in total with
memory.recompute or memory.offload (the planner charges what they keep or move to the site, the
measurement to the module that saved it). Sequence parallelism puts the main blocks' pre-norms on
T/tp tokens; the router runs on all T tokens of the TP group on every TP rank.
"""

import json

import pytest
from test_parallel_dims import run_on_ranks

from moefold.config import load_config
from moefold.parallel.dims import ParallelDims, ParallelLayout
from moefold.plan import predict_memory
from moefold.plan.measure import measure_saved_activations

TP = 2
CASES = {
    "qwen3": ("tiny-qwen3", {"moe.first_k_dense": 1}),  # GQA with QK-norm, a dense and an MoE layer
    "deepseek": ("tiny-deepseek", {}),  # MLA with q-LoRA, shared expert, an MTP block (never SP)
    "deepseek-combine": ("tiny-deepseek", {"model.q_lora_rank": 0, "moe.memory_efficient_permute": False}),
    # memory.recompute: the pre-norms keep their input, this rank's share under SP; the QK-norms,
    # head-sharded by apply_tp, stay checkpointed.
    "qwen3-norm": ("tiny-qwen3", {"moe.first_k_dense": 1, "memory.recompute": '["norm"]'}),
    "deepseek-norm": ("tiny-deepseek", {"memory.recompute": '["norm"]'}),
    "qwen3-layer": ("tiny-qwen3", {"memory.recompute": '["layer"]'}),
    # memory.offload: what the sharded linears and (sp) the pre-norms save are DTensors, whose local
    # shards move; offload_min_bytes applies to a shard's size.
    "qwen3-offload": ("tiny-qwen3", {"moe.first_k_dense": 1, "memory.offload": '["norm", "attn_core", "mlp"]',
                                     "memory.offload_min_bytes": 4096}),
    "deepseek-offload": ("tiny-deepseek", {"memory.offload": '["layer"]', "memory.offload_min_bytes": 0}),
}


def _config(name: str, sp: bool):
    preset, overrides = CASES[name]
    return load_config(preset, {**overrides, "train.micro_batch_size": 2, "precision.compute_dtype": "fp32",
                                "parallel.tp": TP, "parallel.sequence_parallel": sp})


def _measure_all(rank: int, out_dir: str) -> None:
    layout = ParallelLayout(ParallelDims(TP, tp=TP))
    measured = {f"{name} sp={sp}": measure_saved_activations(_config(name, sp), "fp32", layout=layout)
                .by_category for name in CASES for sp in (False, True)}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(measured, f)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("saved")
    run_on_ranks(_measure_all, TP, str(out_dir))
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(TP)]
    assert ranks[0] == ranks[1]  # TP ranks hold the same shapes
    return ranks[0]


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("name", CASES)
def test_activations_match_the_tensor_parallel_model(measured, name, sp):
    cfg = _config(name, sp)
    real, planned = measured[f"{name} sp={sp}"], predict_memory(cfg, TP).activations
    assert sum(planned.values()) == pytest.approx(sum(real.values()), rel=1e-3)
    if cfg.memory.recompute or cfg.memory.offload:  # charged to other categories: see above
        return
    for category in set(real) | set(planned):
        assert planned.get(category, 0) == pytest.approx(real.get(category, 0), rel=1e-3), category


def test_sequence_parallelism_puts_the_pre_norms_on_a_tp_share(measured):
    """On tiny-qwen3 (2 layers, 2 pre-norms each, T tokens per TP rank) SP keeps half of each
    pre-norm's fp32 input, normalised rows and rsqrt per row: T/2 · (8·D + 4) bytes a norm."""
    cfg = _config("qwen3", True)
    T, D = cfg.train.micro_batch_size * cfg.train.seq_len, cfg.model.dim
    saving = measured["qwen3 sp=False"]["norm"] - measured["qwen3 sp=True"]["norm"]
    assert saving == 2 * 2 * T // TP * (8 * D + 4)
