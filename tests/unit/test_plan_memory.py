"""The memory planner against independent references: the parameter count of the meta-built
model, the saved-for-backward bytes of the real model run under FakeTensorMode, the published
pipeline rule, ZeRO-1's sharding of optimizer states (ddp), and the CLI."""

import random
import time
from dataclasses import replace

import pytest
import torch
from test_plan_tp import DTYPES
from torch.utils.checkpoint import checkpoint

from moefold.cli import main
from moefold.config import load_config, preset_names
from moefold.plan import activations as act
from moefold.plan import predict_memory
from moefold.plan.measure import measure_saved_activations
from moefold.plan.params import model_params
from moefold.plan.storages import block_storages
from moefold.plan.peaks import measure_head_loss, measure_peaks
from moefold.plan import pipeline
from moefold.plan.pipeline import model_chunks, peak_in_flight, rank_chunks
from moefold.train.flops import count_params, meta_model

DEEPSEEK_256 = ["--config", "deepseek-v3", "--gpus", "256", "--parallel.tp", "1", "--parallel.pp", "8",
                "--parallel.vpp", "4", "--parallel.ep", "32", "--train.micro_batch_size", "1",
                "--train.seq_len", "4096", "--optim.exp_avg_dtype", "bf16",
                "--optim.exp_avg_sq_dtype", "bf16"]


@pytest.mark.parametrize("preset", preset_names())
def test_parameter_count_equals_the_meta_model(preset):
    cfg = load_config(preset)
    model = meta_model(cfg)
    assert model_params(cfg, model.vocab_size).total == count_params(model).total


def test_parameter_count_tied_gelu_gated_shared():
    cfg = load_config("tiny-qwen3", {"model.tie_embeddings": True, "moe.activation": "gelu",
                                     "moe.shared_experts": 2, "moe.shared_expert_gate": True})
    model = meta_model(cfg)
    assert model_params(cfg, model.vocab_size).total == count_params(model).total


ACTIVATION_CASES = [
    ("tiny-qwen3", {}),  # GQA with QK-norm
    ("tiny-qwen3", {"moe.memory_efficient_permute": False}),
    ("tiny-deepseek", {}),  # MLA with q-LoRA, shared expert, groups, expert bias, MTP
    ("tiny-deepseek", {"model.q_lora_rank": 0, "moe.memory_efficient_permute": False}),
    ("tiny-mixtral", {}),  # sliding window, top-k before softmax
    ("tiny-qwen3", {"moe.activation": "gelu", "moe.z_loss_coeff": 1e-3, "moe.shared_experts": 2,
                    "moe.shared_expert_gate": True, "moe.pad_multiple": 16}),
    ("qwen3-30b-a3b", {"model.n_layers": 1, "train.seq_len": 128, "train.micro_batch_size": 1,
                       "model.vocab_size": 4096}),  # real Qwen3-30B-A3B layer shapes
    ("deepseek-v2-lite", {"model.n_layers": 2, "train.seq_len": 128, "train.micro_batch_size": 1,
                          "model.vocab_size": 4096}),
]


def _predicted(cfg, dtype: str) -> dict[str, int]:
    sh = act.Shapes(cfg.train.micro_batch_size, cfg.train.seq_len, 1, 1, 1, 2 if dtype == "bf16" else 4)
    return act.model_bytes(cfg, sh, cfg.model.vocab_size or 257)


def _assert_close(predicted: dict[str, int], measured: dict[str, int], rel: float = 0.10) -> None:
    total = sum(measured.values())
    assert sum(predicted.values()) == pytest.approx(total, rel=rel)
    for key in set(predicted) | set(measured):  # module by module, wherever a module matters
        if max(predicted.get(key, 0), measured.get(key, 0)) > 0.01 * total:
            assert predicted.get(key, 0) == pytest.approx(measured.get(key, 0), rel=rel), key


@pytest.mark.parametrize("preset,overrides", ACTIVATION_CASES)
def test_activations_match_the_model_under_fake_tensors(preset, overrides):
    cfg = load_config(preset, overrides)
    _assert_close(_predicted(cfg, "bf16"), measure_saved_activations(cfg, "bf16").by_category)


FP8_KEPT_CASES = [  # dims aligned to 128, so blockwise converts the experts too
    # fp8_exclude, module by module: one of q/k/v, the routed experts, one shared-expert input
    ("tiny-qwen3", {"moe.expert_hidden": 128, "moe.shared_experts": 1,
                    "precision.fp8_exclude": '["layers.0.attn.wq", "*.experts", "layers.1.ffn.shared.w3"]'},
     "rowwise", 4),
    # a whole dense layer, an MTP projection, and the last layer through fp8_bf16_last_layers
    ("tiny-deepseek", {"moe.expert_hidden": 128, "model.ffn_hidden": 128, "precision.fp8_bf16_last_layers": 1,
                       "precision.fp8_exclude": '["layers.0.ffn", "mtp.*.wkv_b"]'}, "blockwise", 4),
    ("tiny-qwen3", {"moe.expert_hidden": 128, "moe.shared_experts": 1, "moe.shared_expert_gate": True},
     "rowwise", 0),
    ("tiny-qwen3", {"moe.expert_hidden": 128, "model.ffn_hidden": 128}, "tensorwise", 4),
    ("tiny-deepseek", {"moe.expert_hidden": 128, "model.ffn_hidden": 128}, "blockwise", 0),
    ("tiny-deepseek", {"moe.expert_hidden": 128, "model.ffn_hidden": 128, "model.q_lora_rank": 0,
                       "moe.memory_efficient_permute": False}, "rowwise", 4),
]


@pytest.mark.parametrize("preset,overrides,recipe,param_bytes", FP8_KEPT_CASES)
def test_fp8_kept_inputs_are_predicted(preset, overrides, recipe, param_bytes):
    """precision.fp8_saved_activations: the analytic count of every module kind equals the FP8
    model's under fake tensors (apply_fp8's choice of which linears keep FP8 inputs, their scales,
    unaligned linears left in bf16, MTP blocks sharing their inputs), with bf16 and with fp32
    parameters under autocast; and it is below plain FP8's."""
    cfg = load_config(preset, {**overrides, "model.dim": 128, "precision.fp8": recipe,
                               "precision.fp8_saved_activations": True})
    sh = act.Shapes(cfg.train.micro_batch_size, cfg.train.seq_len, 1, 1, 1, 2, param_bytes=param_bytes)
    predicted = act.model_bytes(cfg, sh, cfg.model.vocab_size or 257)
    measured = measure_saved_activations(cfg, "bf16", param_dtype="fp32" if param_bytes else "").by_category
    _assert_close(predicted, measured, rel=1e-3)
    plain = replace(cfg, precision=replace(cfg.precision, fp8_saved_activations=False))
    assert sum(predicted.values()) < sum(act.model_bytes(plain, sh, cfg.model.vocab_size or 257).values())


WEIGHT_COPY_CASES = [ACTIVATION_CASES[i] for i in (2, 3, 5, 6)]


@pytest.mark.parametrize("preset,overrides", WEIGHT_COPY_CASES)
def test_fp32_parameters_under_autocast_keep_bf16_weight_copies(preset, overrides):
    # fp32 parameters (the fp32-master run): every matmul weight's bf16 cast is kept for backward,
    # and each projection keeps its own bf16 cast of the fp32 normed x.
    cfg = load_config(preset, overrides)
    sh = act.Shapes(cfg.train.micro_batch_size, cfg.train.seq_len, 1, 1, 1, 2, param_bytes=4)
    predicted = act.model_bytes(cfg, sh, cfg.model.vocab_size or 257)
    measured = measure_saved_activations(cfg, "bf16", param_dtype="fp32").by_category
    assert measured["weight_copies"] > 0
    assert predicted["weight_copies"] == pytest.approx(measured["weight_copies"], rel=0.01)
    _assert_close(predicted, measured)


def test_activations_match_a_real_fp32_run():
    cfg = load_config("tiny-deepseek", {"train.micro_batch_size": 2})
    _assert_close(_predicted(cfg, "fp32"), measure_saved_activations(cfg, "fp32").by_category)


def test_memory_efficient_permute_saving_is_predicted():
    on, off = (load_config("tiny-qwen3", {"moe.memory_efficient_permute": flag}) for flag in (True, False))
    measured = measure_saved_activations(off).total - measure_saved_activations(on).total
    predicted = sum(_predicted(off, "bf16").values()) - sum(_predicted(on, "bf16").values())
    assert measured > 0
    assert predicted == pytest.approx(measured, rel=0.10)


@pytest.mark.parametrize("pp,vpp", [(4, 1), (8, 1), (4, 2), (8, 4)])
def test_first_stage_holds_megatron_rule(pp, vpp):
    # Korthikanti et al. 2022: the first stage keeps pp micro-batches of its L/pp layers, times
    # (1 + (pp-1)/(pp·vpp)) when interleaved; in chunk units that is pp·vpp + (pp-1) with vpp > 1.
    expected = pp * vpp + (pp - 1) if vpp > 1 else pp
    assert peak_in_flight([1] * vpp, 8 * pp, pp, 0).bytes == expected
    assert peak_in_flight([1] * vpp, 8 * pp, pp, pp - 1).bytes == (1 if vpp == 1 else (vpp - 1) * pp + 1)


def _replayed_peak(chunk_bytes: list[int], micro_batches: int, pp: int, rank: int) -> int:
    """The largest live sum over the whole schedule, every step replayed."""
    live, best = [0] * len(chunk_bytes), 0
    for kind, chunk in pipeline._order(micro_batches, pp, len(chunk_bytes), rank):
        live[chunk] += 1 if kind == "F" else -1
        best = max(best, sum(n * b for n, b in zip(live, chunk_bytes)))
    return best


@pytest.mark.parametrize("pp,vpp", [(1, 1), (2, 1), (3, 2), (4, 3), (5, 4)])
def test_a_long_schedule_peaks_where_its_start_does(pp, vpp):
    """peak_in_flight replays only the first 4·pp micro-batches (plan memory with
    train.grad_accum=10^9 hung replaying them all): uneven chunks on every rank peak there."""
    gen = random.Random(pp * 10 + vpp)
    for rank in range(pp):
        chunk_bytes = [gen.randint(1, 1000) for _ in range(vpp)]
        for micro_batches in range(pp, 30 * pp + 1, pp):
            peak = peak_in_flight(chunk_bytes, micro_batches, pp, rank).bytes
            assert peak == _replayed_peak(chunk_bytes, micro_batches, pp, rank)
        assert peak_in_flight(chunk_bytes, 10**12 * pp, pp, rank).bytes == peak


def test_uneven_stages_cover_every_layer_once():
    chunks = model_chunks(61, 1, 8, 4)  # DeepSeek-V3: 61 layers + 1 MTP block over 32 chunks
    layers = sorted(i for c in chunks for i in c.layers)
    assert layers == list(range(62))
    assert max(sum(len(c.layers) for c in rank_chunks(chunks, 8, r)) for r in range(8)) == 8


def _state_bytes(plan) -> float:
    return plan.parameters + plan.gradients + plan.master_weights + plan.optimizer_moments


def test_ddp_zero1_shards_optimizer_states():
    # ZeRO-1 (parallel/zero.py): fp32 parameters and gradients replicated (4 + 4), both moments (8)
    # over d data ranks; the optimizer's shards are views of the parameters.
    cfg = load_config("tiny-qwen3", {"parallel.data_parallel": "ddp"})
    n = count_params(meta_model(cfg)).total
    plan = predict_memory(cfg, 4)
    assert _state_bytes(plan) == pytest.approx(n * (8 + 8 / 4))
    assert plan.master_weights == 0
    assert plan.optimizer_moments == pytest.approx(n * 8 / 4)
    lean = load_config("tiny-qwen3", {"parallel.data_parallel": "ddp", "optim.exp_avg_dtype": "bf16",
                                      "optim.exp_avg_sq_dtype": "fp8", "optim.master_dtype": "bf16+remainder"})
    # bf16 parameters and gradients; int16 remainders, bf16 and fp8 (+ a scale per block of up to 128:
    # test_counts_audit.py counts them exactly against the real tensors) moments
    assert _state_bytes(predict_memory(lean, 4)) == pytest.approx(n * (2 + 2 + (2 + 2 + 1 + 4 / 128) / 4), rel=0.01)


def test_ddp_zero1_step_holds_the_full_gradients_and_a_bucket_at_the_reduce_scatter():
    cfg = load_config("tiny-qwen3", {"parallel.data_parallel": "ddp"})
    expert = sum(p.numel() for name, p in meta_model(cfg).named_parameters() if "experts." in name)
    dense = count_params(meta_model(cfg)).total - expert
    plan = predict_memory(cfg, 4)
    step = plan.phases["optimizer step"]
    assert step["gradients"] == plan.gradients  # not yet sharded: the reduce-scatter reads them
    assert step["communication"] == pytest.approx(4 * max(dense, expert) * (1 + 1 / 4))  # fp32 bucket


def test_fsdp_shards_everything_and_low_precision_moments_shrink_states():
    cfg = load_config("tiny-qwen3")
    n = count_params(meta_model(cfg)).total
    # fp32 master, grad, m, v of a quarter of every tensor, but the first rank (the plan's) holds 65
    # of the embedding's and the head's 257 vocabulary rows (FSDP2 cuts dim 0 as torch.chunk does)
    rank0 = n + 2 * (4 * 65 - 257) * cfg.model.dim
    assert _state_bytes(predict_memory(cfg, 4)) == pytest.approx(rank0 * 16 / 4)
    lean = load_config("tiny-qwen3", {"optim.exp_avg_dtype": "fp8", "optim.exp_avg_sq_dtype": "bf16",
                                      "optim.master_dtype": "bf16+remainder"})
    # bf16 parameter + int16 remainder, bf16 gradient, fp8 (+ a scale per block of up to 128:
    # test_counts_audit.py counts them exactly against the real tensors) and bf16 moments
    assert _state_bytes(predict_memory(lean, 1)) == pytest.approx(n * (2 + 2 + 2 + 1 + 4 / 128 + 2), rel=0.01)


def test_fp8_moments_take_a_foreach_workspace_only_where_pieces_cut_their_blocks():
    """The Triton update takes fp8 moments of pieces that hold their 128-element blocks whole (no
    working copies); only last-dimension cuts across a block go through the foreach path's fp32
    copies (optim/blocks.py): TP's and ETP's, and the data ranks' of 1-D weights (kilobytes;
    test_plan_optim_workspace_audit13 measures them all)."""
    fp8 = {"optim.exp_avg_dtype": "fp8", "optim.exp_avg_sq_dtype": "fp8", "optim.master_dtype": "bf16+remainder"}
    step = predict_memory(load_config("tiny-qwen3", fp8), 1).phases["optimizer step"]
    assert step.get("transient", 0) == 0
    # ep 4 over 4 FSDP ranks: the 64-wide norm weights cut to 16 columns, the matrices' rows whole
    step = predict_memory(load_config("tiny-qwen3", {**fp8, "parallel.ep": "4"}), 4).phases["optimizer step"]
    assert 0 < step["transient"] < 32 * 1024
    # tiny-qwen3's wo is 4 heads x 16 wide: 32 columns a TP rank, a quarter of a block
    split = predict_memory(load_config("tiny-qwen3", {**fp8, "parallel.tp": "2"}), 2).phases["optimizer step"]
    assert split["transient"] > 10 * step["transient"]
    # Qwen3-30B-A3B at tp 4: wo 4096 / 4, the shared-less experts untouched, no dense MLP; with 80-wide
    # heads 2560 / 4 = 640 columns, five whole blocks; with 72-wide ones 576, 4.5 blocks. The 8 data
    # ranks cut the QK-norm weights (kilobytes) in each case.
    qwen3 = {**fp8, "parallel.tp": "4", "parallel.ep": "8"}
    for head_dim, cuts in ((128, False), (80, False), (72, True)):
        cfg = load_config("qwen3-30b-a3b", {**qwen3, "model.head_dim": str(head_dim)})
        step = predict_memory(cfg, 32).phases["optimizer step"]
        assert (step["transient"] > 2 ** 20) == cuts, head_dim


def test_expert_parallelism_divides_expert_states():
    base = load_config("tiny-qwen3", {"parallel.data_parallel": "ddp"})
    sharded = load_config("tiny-qwen3", {"parallel.data_parallel": "ddp", "parallel.ep": 4})
    expert = sum(p.numel() for name, p in meta_model(base).named_parameters() if "experts." in name)
    # ddp: fp32 parameters and gradients (8) are replicated, so ep 4 keeps a quarter of them; the
    # moments (8) are sharded over edp, 4 before and 1 after, so they stay.
    saved = _state_bytes(predict_memory(base, 4)) - _state_bytes(predict_memory(sharded, 4))
    assert saved == pytest.approx(expert * 8 * (1 - 1 / 4))
    assert predict_memory(sharded, 4).optimizer_moments == pytest.approx(predict_memory(base, 4).optimizer_moments)


def test_deepseek_v3_on_256_gpus(capsys):
    start = time.monotonic()
    assert main(["plan", "memory", *DEEPSEEK_256, "--device", "gb200"]) == 0
    out = capsys.readouterr().out
    assert time.monotonic() - start < 60
    assert "pipeline rank" in out and "peak" in out and "gb200 (186 GB" in out
    plan = predict_memory(load_config("deepseek-v3", dict(zip(
        [a[2:] for a in DEEPSEEK_256[4::2]], DEEPSEEK_256[5::2]))), 256)
    assert len(plan.layers) == 8 and len(plan.rank_peaks) == 8


@pytest.mark.parametrize("args,message", [
    (["--config", "tiny-qwen3", "--gpus", "3", "--parallel.ep", "2"], "not divisible"),
    (["--config", "tiny-qwen3", "--parallel.vpp", "2"], "parallel.vpp=2 needs parallel.pp > 1"),
    (["--config", "tiny-qwen3", "--parallel.pp", "2", "--parallel.vpp", "2"], "exceeds model.n_layers"),
    (["--config", "tiny-qwen3", "--moe-imbalance", "0.5"], "--moe-imbalance"),
    (["--config", "tiny-qwen3", "--gpus", "0"], "--gpus 0 must be >= 1"),
    (["--config", "tiny-qwen3", "--moe-imbalance", "nan"], "--moe-imbalance=nan must be a finite number"),
    (["--config", "tiny-qwen3", "--moe-imbalance", "inf"], "--moe-imbalance=inf must be a finite number"),
    (["--config", "tiny-qwen3", "--moe-imbalance", "1.5"], "--moe-imbalance=1.5 exceeds parallel.ep=1"),
    (["--config", "tiny-qwen3", "--gpus", "2", "--train.global_batch_size", "100"],
     "train.global_batch_size=100 is not divisible by train.micro_batch_size · dp = 8 · 2"),
    (["--config", "qwen3-30b-a3b", "--gpus", "8", "--parallel.ep", "8", "--moe-imbalance", "1e300"],
     "--moe-imbalance=1e+300 exceeds parallel.ep=8"),
    (["--config", "tiny-qwen3", "--gpu-memory", "nan"], "--gpu-memory nan must be a finite number"),
    (["--config", "tiny-qwen3", "--gpu-memory", "0"], "--gpu-memory 0 must be a finite number > 0"),
])
def test_bad_input_is_one_line(args, message, capsys):
    assert main(["plan", "memory", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


# memory.recompute / memory.offload: the planner's saved bytes and host copies against the real
# model's with the wrappers applied, to the byte (plan.measure runs it for real in every dtype:
# output discarding frees real storages, and offload moves only plain tensors).
# offload_min_bytes 4096 keeps some small tensors on the device. Dtypes by name as test_plan_tp's
# DTYPES: (precision.compute_dtype, optim.master_dtype, measure's dtype and param_dtype).
NOLORA, COMBINE = {"model.q_lora_rank": 0}, {"model.q_lora_rank": 0, "moe.memory_efficient_permute": False}
DENSE_FIRST, FP64_ROUTER = {"moe.first_k_dense": 1}, {"moe.router_dtype": "fp64"}
OPTION_CASES = [(preset, extra, {f"memory.{kind}": f'["{name}"]'}, "fp32") for preset, extra, names in (
    ("tiny-qwen3", {}, ("norm", "attn_core", "moe_act", "moe", "layer")),
    ("tiny-deepseek", {}, ("shared_experts", "mlp", "moe", "mla_up_proj")),
    ("tiny-deepseek", NOLORA, ("mla_up_proj",)),
    ("tiny-mixtral", {}, ("attn_core",))) for name in names for kind in ("recompute", "offload")] + [
    # offload moves the storages of at least offload_min_bytes and leaves the rest: every small one
    # of the router, the dispatcher, the experts, the norms and attention (their list was partial)
    ("tiny-qwen3", {}, {"memory.offload": '["moe"]', "memory.offload_min_bytes": 65536}, "fp32"),
    ("tiny-qwen3", {}, {"memory.offload": '["layer"]', "memory.offload_min_bytes": 65536}, "fp32"),
    ("tiny-deepseek", {}, {"memory.offload": '["layer"]'}, "fp32"),
    ("tiny-deepseek", COMBINE, {"memory.offload": '["moe"]'}, "bf16-fp32-params"),
    ("tiny-mixtral", {}, {"memory.offload": '["moe", "attn_core"]', "memory.offload_min_bytes": 65536}, "bf16"),
    # ... and each storage once per site call: MLA's up-projection copies the RoPE tables, the trunk's
    # freed after forward; the attention output and (without q-LoRA) the normed x are copied but
    # stay (the output projection, wkv_a keep them); the activation keeps silu(gate) too (no
    # memory-efficient permutation)
    ("tiny-deepseek", NOLORA, {"memory.offload": '["mla_up_proj", "attn_core", "shared_experts"]',
                               "memory.offload_min_bytes": 0}, "fp32"),
    ("tiny-deepseek", COMBINE, {"memory.offload": '["moe_act"]'}, "fp32"),
    # fp32 parameters under bf16 autocast: the residual stream and the normed x are fp32, as
    # recomputed pre-norms, layers, MoE layers and MLPs keep them; the fp32 router reads the normed x
    # itself, which recomputing the norms frees. A recomputed site's kept normed x goes with it.
    ("tiny-qwen3", DENSE_FIRST, {"memory.recompute": '["norm"]'}, "bf16-fp32-params"),
    ("tiny-qwen3", {}, {"memory.recompute": '["layer"]'}, "bf16-fp32-params"),
    ("tiny-deepseek", {}, {"memory.recompute": '["moe"]'}, "bf16-fp32-params"),
    ("tiny-deepseek", {}, {"memory.recompute": '["norm", "mlp"]'}, "bf16-fp32-params"),
    ("tiny-qwen3", DENSE_FIRST, {"memory.recompute": '["norm", "moe"]'}, "bf16"),
    ("tiny-deepseek", NOLORA, {"memory.recompute": '["norm", "mla_up_proj"]'}, "bf16-fp32-params"),
    # without the memory-efficient permutation the recomputed activation frees silu(gate) and holds
    # none of the [R] probabilities it is handed and ignores
    ("tiny-deepseek", COMBINE, {"memory.recompute": '["moe_act"]'}, "fp32"),
    # an fp64 router keeps its own cast of the normed x: recomputed shared experts keep the normed
    # x, which recomputing the norms frees
    ("tiny-deepseek", FP64_ROUTER, {"memory.recompute": '["norm", "shared_experts"]'}, "bf16-fp32-params"),
    ("tiny-deepseek", FP64_ROUTER, {"memory.recompute": '["norm"]'}, "fp32"),
]


def _nested(outer: str, inner: str) -> list[dict]:
    """`inner` recomputed inside an offloaded `outer`, offloaded inside a recomputed one, and
    both offloaded."""
    return [{"memory.recompute": f'["{inner}"]', "memory.offload": f'["{outer}"]'},
            {"memory.recompute": f'["{outer}"]', "memory.offload": f'["{inner}"]'},
            {"memory.offload": f'["{inner}", "{outer}"]'}]


# Names nested in one another or sharing storages side by side compose as the wrappers do, storage
# by storage (plan.options): only the innermost saved-tensor hooks run; a checkpoint saves its
# inputs through the hooks around it (so, inside an offloaded site, to the host), a producer holds
# its own; nested offloaded calls each copy what they save; a recomputed producer frees what an
# offloaded consumer copied; an offloaded site in a recomputed region copies nothing when backward
# recomputes it (it copied again, held until the recompute ended: tiny-deepseek in fp32, `layer`
# recomputed with `attn_core` offloaded, 1,986,560 B on the host at most in backward, now 1,589,248
# B, what forward left). Each was wrong while names were planned one by one (in fp32:
# tiny-qwen3's moe_act recomputed in an offloaded moe 17.7% low, tiny-deepseek's mla_up_proj
# recomputed with attn_core offloaded 24.3% low; moe and layer both offloaded, or layer recomputed
# around an offloaded moe, below zero).
AROUND = {"layer": ("norm", "attn_core", "mla_up_proj", "moe_act", "shared_experts", "mlp", "moe"),
          "moe": ("moe_act", "shared_experts")}
NESTED_CASES = [("tiny-deepseek", {}, options, "fp32") for outer, inners in AROUND.items()
                for inner in inners for options in _nested(outer, inner)] + [
    ("tiny-qwen3", {}, {"memory.recompute": '["moe_act"]', "memory.offload": '["moe"]'}, "fp32"),
    ("tiny-qwen3", {}, {"memory.offload": '["moe", "layer"]'}, "fp32"),
    ("tiny-qwen3", {}, {"memory.recompute": '["norm"]', "memory.offload": '["layer"]'}, "bf16-fp32-params"),
    ("tiny-qwen3", {}, {"memory.recompute": '["layer"]', "memory.offload": '["moe"]'}, "bf16"),
    # side by side: the normed x or MLA's q, k and kv, freed by the recomputed producer after the
    # offloaded consumer copied them
    ("tiny-deepseek", {}, {"memory.recompute": '["mla_up_proj"]', "memory.offload": '["attn_core"]'}, "fp32"),
    ("tiny-deepseek", {}, {"memory.recompute": '["norm"]', "memory.offload": '["moe"]'}, "fp32"),
    ("tiny-deepseek", {}, {"memory.recompute": '["norm"]', "memory.offload": '["mlp"]'}, "fp32"),
    ("tiny-deepseek", {}, {"memory.recompute": '["norm"]', "memory.offload": '["shared_experts"]'}, "bf16"),
    # without q-LoRA, fp32 parameters under autocast: x is the up-projection's input
    ("tiny-deepseek", NOLORA, {"memory.recompute": '["norm", "mla_up_proj"]',
                               "memory.offload": '["attn_core", "moe", "layer"]'}, "bf16-fp32-params"),
    # a sliding window's mask is the core's keyword argument: its checkpoint holds it on the device
    ("tiny-mixtral", {}, {"memory.recompute": '["attn_core"]', "memory.offload": '["layer"]'}, "bf16"),
    # ... and one the sequence fits in (128 keys) is plain causal attention: no mask to hold
    ("tiny-mixtral", {"model.sliding_window": 128}, {"memory.recompute": '["attn_core"]', "memory.offload": '["layer"]'},
     "bf16"),
    # a recompute stops at the region's last save of its own, here the output projection's: the
    # FFN norm and the MoE layer, offloaded after it, do not run again
    ("tiny-qwen3", {}, {"memory.recompute": '["layer"]', "memory.offload": '["norm", "moe"]'}, "fp32"),
    ("tiny-deepseek", {}, {"memory.recompute": '["layer"]',
                           "memory.offload": '["norm", "mla_up_proj", "moe_act", "shared_experts"]'},
     "bf16-fp32-params"),
]


def _nonzero(by_category: dict) -> dict:
    return {k: v for k, v in by_category.items() if v}


def _case_config(preset: str, overrides: dict, dtype: str):
    compute, master = DTYPES[dtype][:2]
    min_bytes = {"memory.offload_min_bytes": 4096} if "memory.offload" in overrides else {}  # else refused
    return load_config(preset, {"train.micro_batch_size": 2, **min_bytes,
                                "precision.compute_dtype": compute, "optim.master_dtype": master, **overrides})


@pytest.mark.parametrize("preset,extra,options,dtype", OPTION_CASES + NESTED_CASES,
                         ids=[f"{p}-{e}-{o}-{d}" for p, e, o, d in OPTION_CASES + NESTED_CASES])
def test_recompute_and_offload_match_the_wrapped_model(preset, extra, options, dtype):
    cfg = _case_config(preset, {**extra, **options}, dtype)
    measured = measure_saved_activations(cfg, DTYPES[dtype][2], param_dtype=DTYPES[dtype][3])
    plan = predict_memory(cfg, 1)
    assert measured.total == plan.activation_total
    assert _nonzero(plan.activations) == _nonzero(measured.by_category)
    assert measured.host == plan.offloaded
    assert measured.host_peak == plan.offloaded  # backward copies nothing


STORAGE_CASES = [("tiny-qwen3", {"moe.first_k_dense": 1, "moe.shared_experts": 1, "moe.shared_expert_gate": True}),
                 ("tiny-deepseek", {}), ("tiny-deepseek", COMBINE), ("tiny-deepseek", FP64_ROUTER),
                 ("tiny-mixtral", {})]


@pytest.mark.parametrize("preset,overrides", STORAGE_CASES)
def test_block_storages_are_the_planned_activations(preset, overrides):
    """plan.storages, what recompute and offload act on, lists plan.activations' storages with who
    keeps them: by category the ones saved sum to each block's bytes, MTP block included, at tp 1
    and 2 (with and without sequence parallelism), in fp32, bf16 and with fp32 parameters."""
    for tp, sp in ((1, False), (2, False), (2, True)):
        cfg = load_config(preset, {**overrides, "parallel.tp": tp, "parallel.sequence_parallel": sp})
        for act_bytes, param_bytes in ((4, 0), (2, 0), (2, 4)):
            sh = act.Shapes(2, 64, tp, 1, 1, act_bytes, param_bytes=param_bytes)
            for layer_id in range(cfg.model.n_layers + cfg.model.mtp_layers):
                saved: dict[str, int] = {}
                for s in block_storages(cfg, layer_id, sh):
                    if s.saved_in:
                        act._add(saved, **{s.category: s.nbytes})
                planned = {k: v for k, v in act.layer_bytes(cfg, layer_id, sh).items() if v}
                assert saved == planned, (tp, sp, act_bytes, param_bytes, layer_id)


def test_a_checkpoint_saves_its_inputs_through_the_hooks_around_it():
    """What plan.options and plan.measure rely on: torch.utils.checkpoint (non-reentrant) saves
    its positional inputs through the saved-tensor hooks around its call, so inside an offloaded
    site they go to the host, and holds its keyword arguments itself."""
    packed = []

    def pack(t):
        packed.append(t)
        return t

    x_N = torch.randn(8, requires_grad=True)
    a_N, scale_N = x_N * 2, torch.full((8,), 3.0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y_N = checkpoint(lambda t, scale: (t * scale).sin(), a_N, scale=scale_N, use_reentrant=False)
    assert len(packed) == 1 and packed[0] is a_N  # the ops inside save under the checkpoint's hooks
    y_N.sum().backward()
    assert torch.allclose(x_N.grad, 6 * (a_N * 3).cos())


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_fp64_router_keeps_its_own_cast_of_the_normed_x(dtype):
    """moe.router_dtype=fp64: the router keeps an fp64 cast of the normed x, so the shared experts
    keep the normed x themselves (in fp32 they were counted 0, as where the router's input is that
    very tensor), and the sigmoid scores' per-token sum for balancing is fp64 too. Category by
    category, to the byte."""
    cfg = _case_config("tiny-deepseek", FP64_ROUTER, dtype)
    measured = measure_saved_activations(cfg, DTYPES[dtype][2], param_dtype=DTYPES[dtype][3]).by_category
    assert predict_memory(cfg, 1).activations == measured


def test_plan_counts_offloaded_bytes_and_recompute_lowers_the_peak():
    args = {"model.n_layers": 2, "train.micro_batch_size": 4, "train.seq_len": 4096}
    plain = predict_memory(load_config("qwen3-30b-a3b", args), 1)
    layer = predict_memory(load_config("qwen3-30b-a3b", {**args, "memory.recompute": '["layer"]'}), 1)
    offload = predict_memory(load_config("qwen3-30b-a3b", {**args, "memory.offload": '["moe"]'}), 1)
    assert layer.activation_total < plain.activation_total and layer.offloaded == 0
    assert offload.offloaded > 0
    assert offload.activation_total == pytest.approx(plain.activation_total - offload.offloaded)


# The time order: forward, backward and optimizer-step peaks against one real micro-batch run
# under FakeTensorMode with every storage followed from allocation to release (plan.peaks). GQA
# only: the CPU has a fused attention kernel for it (MLA and masked attention fall back to the math
# kernel, whose [S, S] probabilities a GPU never allocates).
QWEN3_H200 = {"model.n_layers": 6, "train.micro_batch_size": 4, "train.seq_len": 4096}


@pytest.mark.parametrize("preset,overrides,rel", [
    ("qwen3-30b-a3b", QWEN3_H200, 0.01),  # the H200 setting: 96.26 / 100.90 GiB measured there
    ("qwen3-30b-a3b", {"model.n_layers": 2, "train.micro_batch_size": 8, "train.seq_len": 4096,
                       "model.vocab_size": 4096}, 0.10),  # small vocabulary: a layer's backward peaks
    ("tiny-qwen3", {}, 0.10),
])
def test_phase_peaks_match_a_tracked_run(preset, overrides, rel):
    cfg = load_config(preset, overrides)
    measured, plan = measure_peaks(cfg, "fp32"), predict_memory(cfg, 1)
    assert plan.phase_peak("forward") == pytest.approx(measured.forward, rel=rel)
    assert plan.phase_peak("backward") == pytest.approx(measured.backward, rel=rel)
    assert plan.phase_peak("optimizer step") == pytest.approx(measured.after_backward, rel=0.01)
    assert plan.peak == max(plan.phase_peak(p) for p in ("forward", "backward", "optimizer step"))


# train.loss_chunk_tokens: the chunked head + loss keeps only dh [T, D] and dW [V, D] per head (the
# trunk's and each MTP depth's) and no cast of the head weight. The plan counted the logits loss's
# [T, V] fp32 log-probabilities instead: tiny-qwen3, fp32, 2 x 128 tokens, 330,757 B of head
# planned, 131,329 B kept; tiny-deepseek with fp32 parameters under autocast 595,978 B planned,
# 229,890 B kept, and 32,896 B of weight casts too many.
CHUNKED_CASES = [(preset, chunk, dtype) for preset in ("tiny-qwen3", "tiny-deepseek")
                 for chunk in (64, 96) for dtype in DTYPES]  # 256 tokens: 96 leaves a chunk of 64


@pytest.mark.parametrize("preset,chunk,dtype", CHUNKED_CASES)
def test_chunked_loss_activations_match_the_model(preset, chunk, dtype):
    cfg = _case_config(preset, {"train.loss_chunk_tokens": chunk}, dtype)
    measured = measure_saved_activations(cfg, DTYPES[dtype][2], param_dtype=DTYPES[dtype][3]).by_category
    assert predict_memory(cfg, 1).activations == measured


@pytest.mark.parametrize("chunk", [0, 64, 96, 512])
@pytest.mark.parametrize("dtype,input_dtype,param_dtype", [("fp32", "fp32", "fp32"), ("bf16", "bf16", "bf16"),
                                                           ("bf16", "fp32", "fp32")])
def test_head_loss_transients_match_a_tracked_run(chunk, dtype, input_dtype, param_dtype):
    """plan.head's forward and backward workspaces of one head's loss, against the loss alone run
    with every storage followed (plan.peaks): the logits loss and the eager chunked loss (chunks
    dividing the 256 tokens, not dividing them, all in one), with a compute-dtype input or, under
    autocast, an fp32 one and fp32 weights; scalars (the token count, the loss) aside."""
    from moefold.plan.head import HeadShapes, head_losses

    cfg = load_config("tiny-qwen3", {"train.micro_batch_size": 2, "train.loss_chunk_tokens": chunk})
    measured = measure_head_loss(cfg, dtype, input_dtype, param_dtype)
    size = {"fp32": 4, "bf16": 2}
    sh = act.Shapes(2, cfg.train.seq_len, 1, 1, 1, size[dtype], param_bytes=size[param_dtype])
    head = head_losses(cfg, sh, 257)[0]
    assert head.s == HeadShapes(256, 64, 257, size[dtype], size[input_dtype], size[param_dtype])
    assert head.forward_workspace() == pytest.approx(measured.forward, abs=32)
    assert head.backward_workspace() == pytest.approx(measured.backward, abs=32)


@pytest.mark.parametrize("chunk", [4096, 5000])
def test_chunked_loss_phase_peaks_match_a_tracked_run(chunk):
    """The H200 setting with the eager chunked loss (5000 does not divide its 16,384 tokens):
    forward peaks in the last chunk's step, as planned; backward inside the last layer, whose
    working set the plan estimates (+1.7%). The plan counted the logits loss there: forward +9.7%,
    backward +34%."""
    cfg = load_config("qwen3-30b-a3b", {**QWEN3_H200, "train.loss_chunk_tokens": chunk})
    measured, plan = measure_peaks(cfg, "fp32"), predict_memory(cfg, 1)
    assert plan.phase_peak("forward") == pytest.approx(measured.forward, rel=0.01)
    assert plan.phase_peak("backward") == pytest.approx(measured.backward, rel=0.02)
    assert plan.phase_peak("optimizer step") == pytest.approx(measured.after_backward, rel=0.01)
    assert plan.peak < predict_memory(load_config("qwen3-30b-a3b", QWEN3_H200), 1).peak


def test_gradients_appear_in_backward_unless_micro_batches_accumulate():
    one = predict_memory(load_config("qwen3-30b-a3b", QWEN3_H200), 1)
    accumulating = predict_memory(load_config("qwen3-30b-a3b", {**QWEN3_H200, "train.grad_accum": 2}), 1)
    assert one.phases["forward"]["gradients"] == 0
    assert one.phases["backward"]["gradients"] < one.gradients
    assert accumulating.phases["forward"]["gradients"] == accumulating.gradients


@pytest.mark.parametrize("recipe", ["off", "rowwise", "blockwise"])
def test_expert_rows_follow_the_fp8_padding_of_the_built_model(recipe):
    """The planner's R, layer by layer, against the row counts of the model apply_fp8 converted
    (which raises the pad multiple to the FP8 kernels' alignment), also where fp8_exclude or the
    first-layers option keeps a MoE layer or its experts in bf16 (the padding stays moe.pad_multiple),
    and padded to capacity."""
    from moefold.fp8.apply import apply_fp8
    from moefold.models.transformer import build_model

    fp8_only = ({"precision.fp8_exclude": '["layers.0.ffn"]'}, {"precision.fp8_exclude": '["*.experts"]'},
                {"precision.fp8_bf16_first_layers": "1"})  # refused with fp8 off: options that do nothing
    extras = [{}, {"moe.capacity_factor": "1.3", "moe.pad_to_capacity": "true"}, *fp8_only]
    for extra in extras if recipe != "off" else extras[:2]:  # last: the check after the loop
        cfg = load_config("tiny-qwen3", {"model.dim": "128", "moe.expert_hidden": "128", "moe.pad_multiple": "8",
                                         "precision.fp8": recipe, **extra})
        model = build_model(cfg, 257, "cpu", torch.float32)
        apply_fp8(model, cfg.precision, "cpu")
        B, S = cfg.train.micro_batch_size, cfg.train.seq_len
        built = [layer.dispatcher.layout.num_rows(B * S * cfg.moe.top_k) for layer in model.moe_layers()]
        planned = [act.expert_rows(cfg, act.block_shapes(cfg, i, act.Shapes(B, S, 1, 1, 1, 2)))
                   for i in range(cfg.model.n_layers)]
        assert planned == built, extra
    assert (built[0] < built[1]) == (recipe != "off")  # the bf16 layer pads less


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_fp8_weight_cache_bytes_equal_the_built_cache(recipe):
    """precision.fp8_weight_cache: the planner's bytes against the FP8 buffers a refresh writes
    into the built model (with the CUDA backends' layouts, quantized here on the CPU), also where
    fp8_exclude, the first-layers option or ep keep experts out of it or split them."""
    from moefold.fp8.apply import apply_fp8
    from moefold.fp8.grouped import ScaledGroupedMMFp8Gemm, TritonBlockwiseFp8GroupedGemm
    from moefold.fp8.weight_cache import refresh_weight_caches
    from moefold.models.transformer import build_model
    from moefold.moe.experts import Fp8GroupedExperts

    cuda_gemm = ScaledGroupedMMFp8Gemm if recipe == "rowwise" else TritonBlockwiseFp8GroupedGemm
    for extra in ({}, {"precision.fp8_exclude": '["layers.1.ffn.experts"]'}, {"precision.fp8_bf16_first_layers": "1"},
                  {"model.n_layers": "3", "moe.first_k_dense": "0"}):
        cfg = load_config("tiny-qwen3", {"model.dim": "128", "moe.expert_hidden": "128", "precision.fp8": recipe,
                                         "precision.fp8_weight_cache": "true", **extra})
        model = build_model(cfg, 257, "cpu", torch.bfloat16)
        apply_fp8(model, cfg.precision, "cpu", compute_dtype=torch.bfloat16)
        experts = [m for m in model.modules() if isinstance(m, Fp8GroupedExperts)]
        for m in experts:  # the CUDA backend's weight layouts (plain PyTorch: no triton needed)
            m.gemm = object.__new__(cuda_gemm)
        refresh_weight_caches(model)
        fp8_bytes = sum(b.numel() for m in experts for b in m.buffers() if b.dtype == torch.float8_e4m3fn)
        assert fp8_bytes == 2 * sum(p.numel() for m in experts for p in m.parameters()) > 0, extra
        for ep in (1, 2):
            planned = predict_memory(replace(cfg, parallel=replace(cfg.parallel, ep=ep)), world_size=ep).fp8_weight_cache
            assert planned == fp8_bytes / ep, (extra, ep)
    # the dims blockwise's 128-wide tiles need, which training refuses without (as the plan does)
    no_cache = load_config("tiny-qwen3", {"model.dim": "128", "moe.expert_hidden": "128", "precision.fp8": recipe})
    assert predict_memory(no_cache, world_size=1).fp8_weight_cache == 0


@pytest.mark.parametrize("param_dtype", ["", "fp32"])
def test_fp8_weight_cache_activations_are_predicted(param_dtype):
    """With the cache the FP8 experts' backward keeps the cached FP8 w^T (a buffer) instead of w:
    under fp32 parameters the experts' bf16 weight casts are no longer kept. The analytic count
    equals the model's under fake tensors, with bf16 and with fp32 parameters."""
    saved = {}
    for cache in (False, True):
        cfg = load_config("tiny-qwen3", {"model.dim": 128, "moe.expert_hidden": 128, "precision.fp8": "rowwise",
                                         "precision.fp8_weight_cache": cache})
        sh = act.Shapes(cfg.train.micro_batch_size, cfg.train.seq_len, 1, 1, 1, 2, param_bytes=4 if param_dtype else 0)
        measured = measure_saved_activations(cfg, "bf16", param_dtype=param_dtype).by_category
        _assert_close(act.model_bytes(cfg, sh, 257), measured, rel=1e-3)
        saved[cache] = measured.get("weight_copies", 0)
    assert (saved[True] < saved[False]) == bool(param_dtype)
