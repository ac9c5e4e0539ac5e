"""The memory planner's saved activations under tensor parallelism, with and without sequence
parallelism, against the real model's on 2 gloo ranks.

Each rank builds the model, parallelizes it as the trainer does (tp 2) and counts what autograd
keeps for backward, each storage once, a DTensor by its local shard (plan.measure, for real on the
CPU: fp32, bf16 parameters under bf16 autocast, and fp32 parameters under it); the planner's
activations of one micro-batch (predict_memory at tp 2, sp on and off) must equal them category by
category, to the byte, also with memory.recompute or memory.offload (checked in fp32 and with fp32
parameters under bf16 autocast: a storage counts where the first op whose reference stays on the
device saved it, as `kept_inputs` where only a recompute keeps it), as must the bytes offload holds
on the host, when forward ends and at most in backward. Sequence parallelism puts the main blocks'
pre-norms on T/tp tokens, and their MoE layers route the rank's own T/tp tokens (router, balancing
losses, dispatch); their shared experts all-gather the T tokens and reduce-scatter their output.
"""


import pytest
from test_parallel_dims import results_on_ranks

from moefold.config import load_config
from moefold.parallel.dims import ParallelDims, ParallelLayout
from moefold.plan import predict_memory
from moefold.plan.measure import measure_saved_activations

TP = 2
GATED_SHARED = {"moe.first_k_dense": 1, "moe.shared_experts": 1, "moe.shared_expert_gate": True}
CASES = {
    "qwen3": ("tiny-qwen3", {"moe.first_k_dense": 1}),  # GQA with QK-norm, a dense and an MoE layer
    # MLA with q-LoRA, a DeepSeek shared expert, sigmoid scores with DeepSeek's sequence aux loss
    # (per-sequence counts summed over the TP group under SP), an MTP block (never SP)
    "deepseek": ("tiny-deepseek", {}),
    "deepseek-combine": ("tiny-deepseek", {"model.q_lora_rank": 0, "moe.memory_efficient_permute": False}),
    # FP8 inputs kept for backward: under SP wq (no q-LoRA) keeps its all-gathered x and wkv_a the
    # rank's rows, each in FP8, where without SP the two share the normed x (fp8/apply.py)
    "deepseek-combine-fp8": ("tiny-deepseek", {"model.q_lora_rank": 0, "model.qk_rope_head_dim": 16,  # wkv_a: 48
                                               "precision.fp8": "rowwise", "precision.fp8_saved_activations": True}),
    # FP8 tiles each rank's shard: wk's 16 output features and the dense MLP's 48 hidden ones split
    # over tp 2 are not multiples of rowwise's 16, so those linears stay bf16, their inputs kept whole
    "qwen3-fp8-tp-shards": ("tiny-qwen3", {"moe.first_k_dense": 1, "model.head_dim": 8, "model.ffn_hidden": 48,
                                           "precision.fp8": "rowwise", "precision.fp8_saved_activations": True}),
    # rows padded to capacity: without SP (and in the MTP block) the drop runs on the TP group's T
    # tokens and each rank lays its rows out by the capacity of all T (SequenceSplitDispatcher)
    "qwen3-padded": ("tiny-qwen3", {"moe.first_k_dense": 1, "moe.capacity_factor": 1.0, "moe.pad_to_capacity": True}),
    "deepseek-padded": ("tiny-deepseek", {"moe.capacity_factor": 1.0, "moe.pad_to_capacity": True}),
    # an fp64 router keeps its own cast of the normed x: without SP the shared experts keep it
    "deepseek-fp64": ("tiny-deepseek", {"moe.router_dtype": "fp64"}),
    # Qwen2-MoE's gated shared expert: under SP a replicated [T, 1] gate times the rank's rows
    "qwen2-gate": ("tiny-qwen3", GATED_SHARED),
    # every balancing loss on a softmax router: sequence, global-batch, z-loss besides the aux loss
    "qwen3-losses": ("tiny-qwen3", {"moe.first_k_dense": 1, "moe.seq_aux_loss_coeff": 0.001,
                                    "moe.global_aux_loss_coeff": 0.001, "moe.z_loss_coeff": 0.001}),
    # memory.recompute: the pre-norms keep their input, this rank's share under SP, and free their
    # output only before MLA and MoE layers (GQA attention and dense MLPs read a DTensor of it);
    # the QK-norms, head-sharded by apply_tp, stay checkpointed.
    "qwen3-norm": ("tiny-qwen3", {"moe.first_k_dense": 1, "memory.recompute": '["norm"]'}),
    "deepseek-norm": ("tiny-deepseek", {"memory.recompute": '["norm"]'}),
    "qwen3-layer": ("tiny-qwen3", {"memory.recompute": '["layer"]'}),
    # a recomputed MoE layer keeps its input (the rank's shard under SP), recomputed shared experts
    # theirs (under SP the all-gathered tokens)
    "deepseek-moe": ("tiny-deepseek", {"memory.recompute": '["moe"]'}),
    # MLA under SP: the latents on the rank's share, the up-projections' all-gathered inputs, the
    # all-gathered RoPE key (a recomputed up-projection's input), wq's own all-gathered x (no q-LoRA)
    "deepseek-up-proj": ("tiny-deepseek", {"memory.recompute": '["mla_up_proj"]'}),
    "deepseek-combine-up-proj": ("tiny-deepseek", {"model.q_lora_rank": 0, "memory.recompute": '["norm", "mla_up_proj"]'}),
    "deepseek-combine-up-proj-offload": ("tiny-deepseek", {"model.q_lora_rank": 0, "memory.offload": '["mla_up_proj"]',
                                                           "memory.offload_min_bytes": 0}),
    "qwen2-gate-shared": ("tiny-qwen3", {**GATED_SHARED, "memory.recompute": '["shared_experts"]'}),
    # memory.offload: what the sharded linears and (sp) the pre-norms save are DTensors, whose local
    # shards move; offload_min_bytes applies to a shard's size.
    "qwen3-offload": ("tiny-qwen3", {"moe.first_k_dense": 1, "memory.offload": '["norm", "attn_core", "mlp"]',
                                     "memory.offload_min_bytes": 4096}),
    "deepseek-offload": ("tiny-deepseek", {"memory.offload": '["layer"]', "memory.offload_min_bytes": 0}),
    # the small storages offload leaves on the device; the attention output it copies but leaves
    "qwen3-offload-moe": ("tiny-qwen3", {"moe.first_k_dense": 1, "memory.offload": '["moe", "attn_core"]',
                                         "memory.offload_min_bytes": 4096}),
    # names nested in one another or sharing storages, composed storage by storage (plan.options)
    "qwen3-nested": ("tiny-qwen3", {"moe.first_k_dense": 1, "memory.recompute": '["norm", "moe_act", "mlp"]',
                                    "memory.offload": '["moe", "layer"]', "memory.offload_min_bytes": 4096}),
    "deepseek-nested": ("tiny-deepseek", {"memory.recompute": '["moe", "mla_up_proj"]',
                                          "memory.offload": '["norm", "attn_core", "shared_experts"]',
                                          "memory.offload_min_bytes": 0}),
}
# name: (precision.compute_dtype, optim.master_dtype, measure's dtype and param_dtype); the cases
# with memory.recompute or memory.offload run in fp32 and with fp32 parameters under bf16 autocast
DTYPES = {"fp32": ("fp32", "fp32", "fp32", ""), "bf16": ("bf16", "bf16", "bf16", ""),
          "bf16-fp32-params": ("bf16", "fp32", "bf16", "fp32")}
RUNS = [(name, dtype) for name in CASES for dtype in DTYPES
        if dtype != "bf16" or not any(key.startswith("memory.") for key in CASES[name][1])]


def _config(name: str, dtype: str, sp: bool):
    preset, overrides = CASES[name]
    compute, master = DTYPES[dtype][:2]
    return load_config(preset, {**overrides, "train.micro_batch_size": 2, "precision.compute_dtype": compute,
                                "optim.master_dtype": master, "parallel.tp": TP,
                                "parallel.sequence_parallel": sp})


def _measure_all(rank: int) -> dict:
    layout = ParallelLayout(ParallelDims(TP, tp=TP))
    measured = {}
    for name, dtype in RUNS:
        for sp in (False, True):
            run_dtype, param_dtype = DTYPES[dtype][2:]
            saved = measure_saved_activations(_config(name, dtype, sp), run_dtype, param_dtype=param_dtype,
                                              layout=layout)
            measured[f"{name} {dtype} sp={sp}"] = saved.by_category
            measured[f"{name} {dtype} sp={sp} host"] = saved.host
            measured[f"{name} {dtype} sp={sp} host peak"] = saved.host_peak
    return measured


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    ranks = results_on_ranks(_measure_all, TP, tmp_path_factory.mktemp("saved"))
    assert ranks[0] == ranks[1]  # TP ranks hold the same shapes
    return ranks[0]


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("name,dtype", RUNS, ids=[f"{name}-{dtype}" for name, dtype in RUNS])
def test_activations_match_the_tensor_parallel_model(measured, name, dtype, sp):
    cfg = _config(name, dtype, sp)
    real, plan = measured[f"{name} {dtype} sp={sp}"], predict_memory(cfg, TP)
    assert measured[f"{name} {dtype} sp={sp} host"] == plan.offloaded
    assert measured[f"{name} {dtype} sp={sp} host peak"] == plan.offloaded  # backward copies nothing
    planned = plan.activations
    assert sum(planned.values()) == sum(real.values())
    for category in set(real) | set(planned):
        assert planned.get(category, 0) == real.get(category, 0), category


def _dims(name: str) -> tuple[int, int, int, int]:
    """T (the TP group's tokens), D, E, K of a case."""
    cfg = _config(name, "fp32", True)
    T = cfg.train.micro_batch_size * cfg.train.seq_len
    return T, cfg.model.dim, cfg.moe.num_experts, cfg.moe.top_k


def test_sequence_parallelism_puts_the_pre_norms_on_a_tp_share(measured):
    """On tiny-qwen3 (2 layers, 2 pre-norms each, T tokens per TP rank) SP keeps half of each
    pre-norm's fp32 input, normalised rows and rsqrt per row: T/2 · (8·D + 4) bytes a norm."""
    T, D, _, _ = _dims("qwen3")
    saving = measured["qwen3 fp32 sp=False"]["norm"] - measured["qwen3 fp32 sp=True"]["norm"]
    assert saving == 2 * 2 * T // TP * (8 * D + 4)


def test_sequence_parallelism_routes_the_rank_s_own_tokens(measured):
    """Under SP an MoE layer routes the rank's T/tp tokens of the residual stream as they are
    (parallel/sequence.route_sequence_shard). It used to all-gather them, and its router ran on all
    T tokens of the TP group on every rank, so SP left the router's activations as they were
    (Qwen3-30B-A3B at tp 4, ep 8, 4 × 4096: 6.45 GiB a GPU, now 1.61). On tiny-qwen3's MoE layer
    (fp32 router, softmax, renormalised top-k, micro-batch aux loss) the router keeps per token its
    fp32 input (4·D), scores (4·E), ids (8·K), chosen probabilities (4·K) and their sum (4), and
    the aux loss's valid-token mask (1): SP keeps T/tp tokens' fewer. The dispatcher's keep mask is
    the rank's own [T/tp·K] bools, no longer a view of the group's [T·K]."""
    T, D, E, K = _dims("qwen3")
    on, off = measured["qwen3 fp32 sp=True"], measured["qwen3 fp32 sp=False"]
    assert off["router"] - on["router"] == T // TP * (4 * D + 4 * E + 12 * K + 5)
    assert off["moe_dispatch"] - on["moe_dispatch"] == T // TP * K


def test_sequence_parallel_shared_experts_gather_their_input(measured):
    """Under SP shared experts all-gather the rank's tokens into one [T, D] tensor that w1, w3 and
    a gate read; without SP, in fp32, they read the norm's output, which the router keeps already.
    A gated one's product keeps the replicated gate [T, 1] and the rank's T/tp rows of w2's
    reduce-scattered output, not all T. fp32: tiny-deepseek's 2 sequence-parallel MoE layers (its
    MTP block is never SP) keep T·D·4 more each; tiny-qwen3 with a gated shared expert, T·D·4 more
    input and (T − T/tp)·D·4 less output."""
    T, D, _, _ = _dims("deepseek")
    grown = {name: measured[f"{name} fp32 sp=True"]["shared_experts"]
             - measured[f"{name} fp32 sp=False"]["shared_experts"] for name in ("deepseek", "qwen2-gate")}
    assert grown == {"deepseek": 2 * T * D * 4, "qwen2-gate": T * D * 4 - (T - T // TP) * D * 4}
