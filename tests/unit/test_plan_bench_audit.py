"""`moefold plan memory` and `moefold bench` against independent references: the plan refuses the
configs training refuses, in training's words; its parameter and FLOP counts equal counts over the
real built model and FLOP formulas written out per layer; its weight, gradient and optimizer-state
bytes equal the real tensors' sizes on the CPU."""

import pytest

from moefold.cli import main
from moefold.config import load_config
from moefold.errors import UserError
from moefold.train.trainer import Trainer


def _one_line_error(capsys, argv: list[str]) -> str:
    """The line `moefold ARGV` ends with; asserts exit 2 and nothing more on stderr."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.removeprefix("moefold: error: ").rstrip("\n")


def _training_error(overrides: dict[str, str], run_dir) -> str:
    with pytest.raises(UserError) as refused:
        Trainer(load_config("tiny", overrides), run_dir, out=lambda line: None)
    return str(refused.value)


# Configs whose validation passes but which training refuses once it builds the model or reads
# the tokenizer (bf16 compute, as the plan assumes for a GPU).
REFUSED_BY_TRAINING = {
    "fp8_exclude matching no module": {"precision.fp8": "tensorwise", "precision.fp8_exclude": '["nomatch"]'},
    "fp8 experts unaligned": {"precision.fp8": "blockwise", "moe.expert_hidden": "200"},
    "fp8 experts unaligned for tensorwise": {"precision.fp8": "tensorwise", "moe.expert_hidden": "72"},
    "grouped_mm experts unaligned": {"moe.experts_backend": "grouped_mm", "moe.expert_hidden": "100"},
    "vocabulary below the tokenizer's": {"model.vocab_size": "100"},
}


@pytest.mark.parametrize("name", list(REFUSED_BY_TRAINING))
def test_plan_refuses_what_training_refuses_with_its_message(capsys, tmp_path, name):
    """The plan accepted each of these and printed a prediction for a run that cannot start."""
    overrides = {**REFUSED_BY_TRAINING[name], "precision.compute_dtype": "bf16"}
    expected = _training_error(overrides, tmp_path / "run")
    argv = [arg for key, value in overrides.items() for arg in (f"--{key}", value)]
    assert _one_line_error(capsys, ["plan", "memory", "--config", "tiny", *argv]) == expected


def test_plan_refuses_the_fp8_weight_cache_where_fsdp_shards_the_experts(capsys):
    """Training refuses precision.fp8_weight_cache under FSDP with edp > 1 (Trainer); the plan
    printed the cache's bytes for it. With ddp, or edp 1, the plan still answers."""
    cache = ["plan", "memory", "--config", "tiny", "--precision.fp8", "tensorwise",
             "--precision.fp8_weight_cache", "true"]
    assert _one_line_error(capsys, [*cache, "--gpus", "2"]) == (
        "precision.fp8_weight_cache=true needs the experts' weights whole on each rank; "
        "parallel.data_parallel=fsdp shards them over edp=2: use parallel.data_parallel=ddp, or set "
        "precision.fp8_weight_cache=false")
    assert main([*cache, "--gpus", "2", "--parallel.data_parallel", "ddp"]) == 0
    assert main([*cache, "--gpus", "2", "--parallel.ep", "2"]) == 0



def test_plan_refuses_fp8_experts_whose_etp_slice_is_unaligned(capsys):
    """Training refuses FP8 experts whose ETP slice the kernels cannot tile (fp8/apply.py, on the
    ranks); the plan of the same layout says the same line (a slice of 48 / 2 = 24 features)."""
    argv = ["plan", "memory", "--config", "tiny", "--precision.fp8", "tensorwise", "--moe.expert_hidden", "48"]
    assert main([*argv, "--gpus", "2"]) == 0  # 48 is a multiple of 16
    err = _one_line_error(capsys, [*argv, "--gpus", "2", "--parallel.etp", "2"])
    assert err.startswith("precision.fp8=tensorwise needs model.dim (128) and moe.expert_hidden / parallel.etp"), err


def test_plan_of_weights_no_tensor_can_hold_is_one_line(capsys):
    """The meta build (plan/refuse.py) of a model with a [4e9, 4e9] weight raised torch's overflow
    RuntimeError as a traceback; it is `config params`'s one-line error now."""
    err = _one_line_error(capsys, ["plan", "memory", "--config", "tiny", "--model.dim", "4000000000",
                                   "--precision.fp8", "tensorwise"])
    assert err.startswith("a weight of this model would hold more elements than a tensor can"), err


# ----------------------------------------------------------------- parameter and FLOP counts

def _attention_params(m) -> int:
    """One block's attention weights, written out from the config."""
    D, H = m.dim, m.n_heads
    if m.attention == "mla":
        Q, C, Dn, Dr, Dv = m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        wq = D * Q + Q + Q * H * (Dn + Dr) if Q else D * H * (Dn + Dr)  # q-LoRA: down, its norm, up
        wkv = D * (C + Dr) + C + C * H * (Dn + Dv)  # down to the latent and the rope key, norm, up
        return wq + wkv + H * Dv * D
    Dh, G = m.head_dim or D // H, m.n_kv_heads or H
    return D * H * Dh + 2 * D * G * Dh + H * Dh * D + (2 * Dh if m.qk_norm else 0)


def _ffn_params(cfg, moe_layer: bool, experts: int) -> int:
    """One block's FFN weights with `experts` routed experts counted (K for the active count)."""
    m, moe = cfg.model, cfg.moe
    if not moe_layer:
        return 3 * m.dim * m.ffn_hidden
    shared = 3 * m.dim * moe.shared_experts * (moe.shared_expert_hidden or moe.expert_hidden)
    return moe.num_experts * m.dim + experts * 3 * m.dim * moe.expert_hidden + shared \
        + (m.dim if moe.shared_expert_gate and moe.shared_experts else 0)


def _independent_counts(cfg, vocab: int) -> tuple[int, int, int]:
    """(total, active without the embedding lookup, training FLOPs per token) by the convention of
    docs/metrics.md: 6 · active (+ the head once more per MTP depth) + causal attention."""
    from moefold.models.transformer import is_moe_layer

    m, moe, S = cfg.model, cfg.moe, cfg.train.seq_len
    total = active = attention_flops = 0
    for layer in range(m.n_layers + m.mtp_layers):
        moe_layer = is_moe_layer(cfg, layer)
        block = 2 * m.dim + _attention_params(m)
        total += block + _ffn_params(cfg, moe_layer, moe.num_experts)
        active += block + _ffn_params(cfg, moe_layer, moe.top_k)
        W = m.sliding_window if 0 < m.sliding_window < S else S
        pairs = S * W - W * W / 2  # (query, key) pairs under the causal mask, diagonal halved
        qk, v = ((m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim) if m.attention == "mla"
                 else (m.head_dim or m.dim // m.n_heads,) * 2)
        attention_flops += 3 * 2 * m.n_heads * (qk + v) * pairs / S  # QKᵀ and AV, fwd + bwd
    mtp_extra = m.mtp_layers * (3 * m.dim + 2 * m.dim * m.dim)  # enorm, hnorm, final norm, eh_proj
    head = vocab * m.dim
    active += m.dim + head + mtp_extra
    total += m.dim + head + mtp_extra + (0 if m.tie_embeddings else vocab * m.dim)
    flops = 6 * active + 6 * m.mtp_layers * head + attention_flops
    return total, active, int(flops)


COUNT_CASES = {
    "tiny": ("tiny", {}),
    "tiny-deepseek": ("tiny-deepseek", {}),
    "deepseek no q-LoRA, gated shared, tied": ("tiny-deepseek", {
        "model.q_lora_rank": "0", "moe.shared_expert_gate": "true", "moe.shared_expert_hidden": "48",
        "model.tie_embeddings": "true", "model.mtp_layers": "2"}),
    "tiny-mixtral (sliding window)": ("tiny-mixtral", {}),
    "tiny-qwen3": ("tiny-qwen3", {}),
}


@pytest.mark.parametrize("name", list(COUNT_CASES))
def test_counts_equal_the_built_model_and_the_written_out_formulas(name):
    """The planner's parameter split, count_params (bench's and training's active count) and
    train_flops_per_token against numel over the real model and per-layer formulas."""
    from moefold.data.tokenizer import model_vocab_size
    from moefold.plan.params import model_params
    from moefold.train.flops import config_param_counts, count_params, meta_model, train_flops_per_token

    preset, overrides = COUNT_CASES[name]
    cfg = load_config(preset, overrides)
    vocab = model_vocab_size(cfg)
    model = meta_model(cfg)
    numel = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    total, active, flops = _independent_counts(cfg, vocab)
    assert numel == total
    assert model_params(cfg, vocab).total == total
    counts = count_params(model)
    assert (counts.total, counts.active) == (total, active)
    assert config_param_counts(cfg, vocab) == counts
    assert train_flops_per_token(model, cfg.train.seq_len) == flops


# ------------------------------------------------- states against the real tensors on the CPU

def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


STATE_DTYPES = {
    "fp32": {},
    "bf16 moments": {"optim.exp_avg_dtype": "bf16", "optim.exp_avg_sq_dtype": "bf16"},
    "bf16 master": {"optim.master_dtype": "bf16", "optim.exp_avg_dtype": "bf16"},
    "bf16+remainder, fp8 moments": {"optim.master_dtype": "bf16+remainder", "optim.exp_avg_dtype": "fp8",
                                    "optim.exp_avg_sq_dtype": "fp8"},
}


@pytest.mark.parametrize("name", list(STATE_DTYPES))
def test_state_bytes_equal_the_real_tensors_after_a_step(tmp_path, name):
    """One process: the plan's parameters, gradients, remainders and moments against the bytes of
    the model's parameters, their .grad after backward and the optimizer's states after a step
    (the fp8 moments' per-128 scales are one per block of the last dim: a 32-wide norm weight has
    one scale for 32 elements, not a quarter, hence the tolerance there)."""
    from moefold.plan import predict_memory

    cfg = load_config("tiny", {**STATE_DTYPES[name], "train.micro_batch_size": "1", "train.seq_len": "16"})
    trainer = Trainer(cfg, tmp_path / "run", out=lambda line: None)
    params = list(trainer.model.parameters())
    trainer.accumulate_gradients()
    grads = _nbytes(p.grad for p in params)
    trainer.optimizer_step()
    states = [s for p in params for s in trainer.optimizer.state[p].items() if s[0] != "step"]
    plan = predict_memory(cfg, 1, vocab_size=trainer.vocab_size)
    assert plan.parameters == _nbytes(params)
    assert plan.gradients == grads
    assert plan.master_weights == _nbytes(t for k, t in states if k == "master_remainder")
    moments = _nbytes(t for k, t in states if k != "master_remainder")
    assert plan.optimizer_moments == pytest.approx(moments, rel=1e-3 if "fp8" in name else 1e-12)


# ------------------------------------------------------------------ bench's tokens/s meaning

def test_bench_says_its_tokens_per_s_is_per_device_and_gives_the_job_s(tmp_path, capsys):
    """Training's metrics.jsonl logs tokens_per_s of the whole job (docs/metrics.md); bench's
    record keeps one device's (benchmarks/weak_scaling.py compares them across world sizes). The
    table of a several-rank bench said '… per device' only, and the code said training logs the
    same; the table now gives the job's figure beside it, and the help says which it is."""
    import json

    from moefold.bench.run import format_record

    path = tmp_path / "r.json"
    assert main(["bench", "--config", "tiny", "--steps", "1", "--warmup", "0", "--train.micro_batch_size", "2",
                 "--train.seq_len", "32", "--json", str(path)]) == 0
    record = {**json.loads(path.read_text()), "world": 4, "tokens_per_s": 1000.0}
    line = next(row for row in format_record(record).splitlines() if row.startswith("tokens/s"))
    assert line.split(None, 1)[1] == "1,000 per device, 4,000 for the job of 4 ranks"
    capsys.readouterr()
    assert main(["bench", "--help"]) == 0
    assert "tokens/s per device" in " ".join(capsys.readouterr().out.split())


# ------------------------------------- states on 2 gloo ranks against each rank's real tensors

SHARDED = {
    "fsdp, ep 2": {"parallel.ep": "2"},
    "ddp (ZeRO-1), ep 2": {"parallel.ep": "2", "parallel.data_parallel": "ddp"},
    "ddp, bf16+remainder, bf16 moments": {"parallel.data_parallel": "ddp", "optim.master_dtype": "bf16+remainder",
                                          "optim.exp_avg_dtype": "bf16"},
    "ddp, tp 2": {"parallel.tp": "2", "parallel.data_parallel": "ddp"},
    "fsdp, tp 2, etp 2": {"parallel.tp": "2", "parallel.etp": "2"},
}


def _local_bytes(tensors) -> int:
    from moefold.parallel.local import local_tensor

    return _nbytes(local_tensor(t) for t in {id(t): t for t in tensors}.values())


def planned_and_held_states(cfg, run_dir: str, world: int) -> dict:
    """(planned, this rank's real) bytes of parameters, full gradients before the data-parallel
    reduction, remainders and moments after a step of `cfg` on `world` ranks."""
    from moefold.plan import predict_memory

    trainer = Trainer(cfg, run_dir, out=lambda line: None)
    params = list(trainer.model.parameters())
    grads, reduce = [], trainer.data_parallel.reduce_gradients
    trainer.data_parallel.reduce_gradients = lambda: (grads.append(
        _local_bytes(p.grad for p in params if p.grad is not None)), reduce())
    trainer.accumulate_gradients()
    optimized = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    trainer.optimizer_step()
    states = [(k, t) for p in optimized for k, t in trainer.optimizer.state[p].items() if k != "step"]
    plan = predict_memory(cfg, world, vocab_size=trainer.vocab_size)
    return {"parameters": (plan.parameters, _local_bytes(params)), "gradients": (plan.gradients, grads[0]),
            "master_weights": (plan.master_weights, _local_bytes(t for k, t in states if k == "master_remainder")),
            "optimizer_moments": (plan.optimizer_moments,
                                  _local_bytes(t for k, t in states if k != "master_remainder"))}


def _states_on_rank(rank: int, run_dir: str) -> dict:
    """Per layout: `planned_and_held_states` on 2 ranks."""
    out = {}
    for name, overrides in SHARDED.items():
        cfg = load_config("tiny-qwen3", {**overrides, "train.micro_batch_size": "1", "train.seq_len": "16"})
        out[name] = planned_and_held_states(cfg, f"{run_dir}/{len(out)}-{rank}", 2)
    return out


def test_state_bytes_equal_each_rank_s_real_tensors_under_dp_and_ep(tmp_path):
    """2 gloo ranks: the plan's per-GPU parameters, gradients (ddp: whole until reduce-scattered),
    remainders and moments against each rank's local tensors. FSDP cuts an odd first dim unevenly
    (the 257 vocabulary rows: 129 and 128, 256 bytes), so under fsdp the plan is rank 0's, the
    busiest (test_plan_padded_audit13)."""
    from test_parallel_dims import results_on_ranks

    ranks = results_on_ranks(_states_on_rank, 2, tmp_path, str(tmp_path))
    for name in SHARDED:
        for part in ("parameters", "gradients", "master_weights", "optimizer_moments"):
            planned, real = ranks[0][name][part][0], [r[name][part][1] for r in ranks]
            if name.startswith("fsdp"):
                assert planned == real[0] == max(real), (name, part, real)
            else:
                assert [planned] * 2 == real, (name, part)


def _bench_loss_on_rank(rank: int) -> float:
    from moefold.bench.run import run_bench

    cfg = load_config("tiny", {"train.micro_batch_size": "1", "train.seq_len": "16"})
    return run_bench(cfg, steps=1, warmup=0).record["loss"]


def test_bench_loss_is_the_mean_over_data_ranks_as_training_logs_it(tmp_path):
    """Training logs the loss averaged over the data ranks; bench's record took each rank's own
    micro-batch loss, so rank 0 printed its rows' loss alone and the ranks' records disagreed."""
    from test_parallel_dims import results_on_ranks

    losses = results_on_ranks(_bench_loss_on_rank, 2, tmp_path)
    assert losses[0] == losses[1], losses
