"""Counts and reports against independent references: the parameter counts every output prints
(training's header, `moefold bench`, `moefold config params`) against a count by hand over the
model's real tensors; the planner's fp8 moment scales against PrecisionAwareAdamW's real state;
docs/architecture.md's module listing against the package; the FLOP convention against a count
of one layer's matmuls by hand; `generate`'s sampling against a naive sampler."""

import math
import re

import pytest
import torch

from moefold.config import load_config
from moefold.data.tokenizer import model_vocab_size
from moefold.models.transformer import build_model

# ------------------------------------------------------------------ parameter counts, every output

# MLA with q-LoRA, a dense first layer, a shared expert and one MTP module; a vocabulary large
# enough that leaving the embedding in or out moves the printed figures.
MTP_SHARED = ("tiny-deepseek", {"model.vocab_size": "2048", "train.micro_batch_size": "1",
                                "train.seq_len": "16", "train.device": "cpu"})


def _hand_counts(model, cfg) -> dict[str, int]:
    """DeepSeek-V3's convention (its card's 671B total, 37B activated): every tensor of the main
    model once (embedding and output head in, a tied one once), routed experts' tensors at top_k of
    num_experts for `active`; the MTP modules (the checkpoint's 14B more) apart."""
    out = dict.fromkeys(["total", "active", "mtp", "mtp_active"], 0)
    for name, p in model.named_parameters():  # each tensor once
        share = cfg.moe.top_k / cfg.moe.num_experts if ".experts." in name else 1
        total, active = ("mtp", "mtp_active") if name.startswith("mtp.") else ("total", "active")
        out[total] += p.numel()
        out[active] += round(p.numel() * share)
    return out


def _figures(text: str, *labels: str) -> list[float]:
    """The counts `text` prints before each label ('0.22M parameters'), or after it
    ('active per token:  0.22M'), in parameters."""
    units = {"K": 1e3, "M": 1e6, "B": 1e9}
    out = []
    for label in labels:
        m = (re.search(rf"([\d.,]+)([KMB]) {label}\b", text)
             or re.search(rf"{label}:? +([\d.,]+)([KMB])\b", text))
        assert m, f"no count for {label!r} in {text!r}"
        out.append(float(m.group(1).replace(",", "")) * units[m.group(2)])
    return out


def _assert_printed(text: str, labels: tuple[str, ...], expected: list[int]):
    """Each printed figure is the count, to the printed precision (two decimals of M here)."""
    for label, printed, count in zip(labels, _figures(text, *labels), expected):
        assert printed == pytest.approx(count, abs=0.005e6 + 1), (label, text)


def _counted(preset, overrides):
    cfg = load_config(preset, overrides)
    model = build_model(cfg, model_vocab_size(cfg))  # real tensors on the CPU
    return cfg, _hand_counts(model, cfg)


def test_config_params_prints_the_hand_counted_parameters(capsys):
    from moefold.cli import main

    cfg, hand = _counted(*MTP_SHARED)
    argv = [a for k, v in MTP_SHARED[1].items() for a in (f"--{k}", v)]
    assert main(["config", "params", "--config", MTP_SHARED[0], *argv]) == 0
    text = capsys.readouterr().out
    _assert_printed(text, ("total parameters", "active per token"), [hand["total"], hand["active"]])
    mtp = re.search(r"MTP modules: +([\d.]+)M more, ([\d.]+)M active", text)
    assert [float(x) * 1e6 for x in mtp.groups()] == pytest.approx([hand["mtp"], hand["mtp_active"]], abs=5e3)


def test_bench_prints_the_hand_counted_parameters():
    """bench printed every parameter (MTP in) and the active count without the embedding but with
    the MTP module: 0.53M parameters, 0.29M active where `config params` said 0.45M and 0.37M."""
    from moefold.bench.run import format_record, run_bench

    cfg, hand = _counted(*MTP_SHARED)
    r = run_bench(cfg, steps=1, warmup=0).record
    assert (r["params_total"], r["params_active"]) == (hand["total"], hand["active"])
    assert (r["params_mtp"], r["params_mtp_active"]) == (hand["mtp"], hand["mtp_active"])
    model_row = next(line for line in format_record(r).splitlines() if line.lstrip().startswith("model"))
    _assert_printed(model_row, ("parameters", "active"), [hand["total"], hand["active"]])


def test_training_header_prints_the_hand_counted_parameters(tmp_path):
    from moefold.bench.run import BenchTrainer

    cfg, hand = _counted(*MTP_SHARED)
    lines = []
    BenchTrainer(cfg, tmp_path / "run", out=lines.append)._announce()  # what `train` prints first
    header = next(line for line in lines if line.startswith("model:"))
    _assert_printed(header, ("parameters", "active"), [hand["total"], hand["active"]])


# ----------------------------------------------- fp8 moments' scales against the optimizer's own

FP8_MOMENTS = {"optim.exp_avg_dtype": "fp8", "optim.exp_avg_sq_dtype": "fp8", "train.micro_batch_size": "1",
               "train.seq_len": "16", "train.device": "cpu"}
FP8_CASES = {
    "tiny-qwen3": ("tiny-qwen3", {}),  # 64-wide rows and 16-wide QK-norms: half and an eighth of a block
    "tiny-deepseek": ("tiny-deepseek", {}),  # MLA's 32- and 40-wide rows, an MTP module
    "tiny, fp8 master": ("tiny", {"optim.master_dtype": "bf16+remainder", "moe.shared_experts": "1",
                                  "moe.shared_expert_gate": "true", "moe.activation": "gelu"}),
    "tiny-mixtral, one fp8 moment": ("tiny-mixtral", {"optim.exp_avg_sq_dtype": "bf16",
                                                      "model.tie_embeddings": "true"}),
}


@pytest.mark.parametrize("name", list(FP8_CASES))
def test_planned_fp8_moments_equal_precision_aware_adamw_s_tensors(tmp_path, name):
    """One process: the plan's moment bytes against PrecisionAwareAdamW's states after a step. It
    planned 4/128 bytes of scale per element, where the optimizer keeps one fp32 scale per block of
    128 along each row, a short row's block whole: tiny-qwen3's 324,192 planned bytes against
    342,232 real (5.3% under)."""
    from moefold.optim.precision import PrecisionAwareAdamW
    from moefold.plan import predict_memory
    from moefold.train.trainer import Trainer

    preset, overrides = FP8_CASES[name]
    cfg = load_config(preset, {**FP8_MOMENTS, **overrides})
    trainer = Trainer(cfg, tmp_path / "run", out=lambda line: None)
    assert isinstance(trainer.optimizer, PrecisionAwareAdamW)
    trainer.accumulate_gradients()
    trainer.optimizer_step()
    states = [t for p in trainer.model.parameters() for k, t in trainer.optimizer.state[p].items()
              if k.startswith("exp_avg")]
    real = sum(t.numel() * t.element_size() for t in states)
    assert predict_memory(cfg, 1, vocab_size=trainer.vocab_size).optimizer_moments == real


FP8_SHARDED = {
    "fsdp, tp 2, etp 2": {"parallel.tp": "2", "parallel.etp": "2"},  # wo's and w1's 64 and 32 columns cut in two
    "fsdp, dp 2": {},
    "ddp, ep 2": {"parallel.ep": "2", "parallel.data_parallel": "ddp"},
    "ddp, tp 2": {"parallel.tp": "2", "parallel.data_parallel": "ddp"},
}


def _fp8_moments_on_rank(rank: int, run_dir: str) -> dict:
    """Per layout: (planned, this rank's real) bytes of the fp8 moments and their scales."""
    from moefold.parallel.local import local_tensor
    from moefold.plan import predict_memory
    from moefold.train.trainer import Trainer

    out = {}
    for name, overrides in FP8_SHARDED.items():
        cfg = load_config("tiny-qwen3", {**FP8_MOMENTS, **overrides})
        trainer = Trainer(cfg, f"{run_dir}/{len(out)}-{rank}", out=lambda line: None)
        trainer.accumulate_gradients()
        trainer.optimizer_step()
        states = {id(t): local_tensor(t) for s in trainer.optimizer.state.values() for k, t in s.items()
                  if k.startswith("exp_avg")}
        real = sum(t.numel() * t.element_size() for t in states.values())
        out[name] = (predict_memory(cfg, 2, vocab_size=trainer.vocab_size).optimizer_moments, real)
    return out


def test_planned_fp8_moments_equal_each_rank_s_tensors(tmp_path):
    """2 gloo ranks: a cut of a row's block leaves each rank the whole row's scales; FSDP splits an
    odd first dim unevenly (257 vocabulary rows: 129 and 128), so the plan is rank 0's, the busiest
    (test_plan_padded_audit13)."""
    from test_parallel_dims import results_on_ranks

    ranks = results_on_ranks(_fp8_moments_on_rank, 2, tmp_path, str(tmp_path))
    for name in FP8_SHARDED:
        planned, real = ranks[0][name][0], [r[name][1] for r in ranks]
        assert planned == real[0] == max(real), (name, planned, real)


# ------------------------------------------------- docs/architecture.md's listing of the modules

def _listed_modules(text: str) -> list[str]:
    """The paths of the `src/moefold/` listing in docs/architecture.md: one line a module (or a
    folder, ending in '/'), nested by indentation, its description after the name."""
    block = re.search(r"```\nsrc/moefold/\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no ``` block starting with the line src/moefold/"
    listed, folders = [], []  # folders: (indent, name) of the enclosing folders
    for line in block.group(1).splitlines():
        indent, name = len(line) - len(line.lstrip()), line.split()[0]
        assert name.endswith(("/", ".py", ".toml")), f"not one module a line: {line!r}"
        folders = [(i, f) for i, f in folders if i < indent]
        if name.endswith("/"):
            folders.append((indent, name))
        elif name.endswith(".py"):
            listed.append("".join(f for _, f in folders) + name)
    return listed


def test_architecture_md_lists_every_module_once():
    from pathlib import Path

    import moefold

    package = Path(moefold.__file__).parent
    modules = sorted(str(p.relative_to(package)) for p in package.rglob("*.py"))
    listed = _listed_modules((Path(__file__).parents[2] / "docs/architecture.md").read_text())
    assert sorted(listed) == sorted(set(listed)), "a module listed twice"
    assert set(modules) - set(listed) == set(), "modules the listing leaves out"
    assert set(listed) - set(modules) == set(), "listed modules that do not exist"


# ------------------------------------------------ the FLOP convention against the counted matmuls

FLOP_CASES = {
    "GQA, MoE": ("tiny-qwen3", {"model.n_layers": "1", "moe.first_k_dense": "0"}),
    "GQA, MoE, MTP": ("tiny-qwen3", {"model.n_layers": "1", "moe.first_k_dense": "0", "model.mtp_layers": "1"}),
    "MLA, MoE + shared, MTP": ("tiny-deepseek", {"model.n_layers": "1", "moe.first_k_dense": "0"}),
    "MLA, dense": ("tiny-deepseek", {"model.n_layers": "1", "model.mtp_layers": "0"}),
    "MLA without q-LoRA, MoE": ("tiny-deepseek", {"model.n_layers": "1", "moe.first_k_dense": "0",
                                                                  "model.q_lora_rank": "0", "model.mtp_layers": "0"}),
}


@pytest.mark.parametrize("name", list(FLOP_CASES))
def test_train_flops_per_token_equal_the_counted_matmuls(name):
    """One layer (and its MTP depth): torch's FlopCounterMode over a real forward and backward
    counts every matmul (`mm`: the linears, the router, each expert's rows with the loop backend,
    the head once per depth) and, on SDPA's math path, QKᵀ and AV over all S² pairs (`bmm`). The
    convention's count is the mm's, the norm weights' 6 per token (which it counts as parameters),
    and half the bmm's (the causal mask)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from moefold.train.flops import train_flops_per_token
    from moefold.train.loss import build_objective

    preset, overrides = FLOP_CASES[name]
    cfg = load_config(preset, {**overrides, "moe.experts_backend": "loop", "train.device": "cpu"})
    model = build_model(cfg, model_vocab_size(cfg))
    B, S = 2, 32
    ids_BS1 = torch.randint(0, model.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        loss, _ = build_objective(model)(model, ids_BS1[:, :-1], ids_BS1[:, 1:])
        loss.backward()
    counted = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert set(counted) == {"aten.mm", "aten.bmm"}, counted
    m = cfg.model
    qk, v = (m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim) if m.attention == "mla" else (m.head_dim,) * 2
    # forward 2 FLOPs a multiply-add of QKᵀ and AV per (query, key) pair and head, backward twice that
    assert counted["aten.bmm"] == 3 * 2 * m.n_heads * (qk + v) * S * S * B * (m.n_layers + m.mtp_layers)
    norms = sum(p.numel() for p in model.parameters() if p.ndim == 1)
    assert train_flops_per_token(model, S) * B * S == counted["aten.mm"] + 6 * norms * B * S + counted["aten.bmm"] // 2


# ------------------------------------------------------------- generate's sampling, naively

def _naive_probs(logits_V: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """Top-k (ties with the k-th kept, as transformers' TopKLogitsWarper), then softmax(logits / T),
    written out in Python floats."""
    values = logits_V.tolist()
    ranked = sorted(values, reverse=True)
    kth = ranked[top_k - 1] if 0 < top_k < len(values) else ranked[-1]
    weights = [math.exp((v - ranked[0]) / temperature) if v >= kth else 0.0 for v in values]
    return torch.tensor(weights, dtype=torch.float64) / sum(weights)


PICKS = {"T 0.7, top-k 5": (0.7, 5), "T 1.3, all": (1.3, 0), "T 3, top-k 3 with a tie at the 3rd": (3.0, 3),
         "T 1e-30 (greedy)": (1e-30, 0), "top-k above V": (1.0, 100), "T inf, top-k 4 (uniform)": (math.inf, 4)}


@pytest.mark.parametrize("name", list(PICKS))
def test_pick_samples_from_the_naive_distribution(monkeypatch, name):
    """The distribution `_pick` hands torch.multinomial equals the naive one; and over 4,000 seeded
    draws each token's frequency is within 5 standard deviations of its probability."""
    from moefold import generate

    temperature, top_k = PICKS[name]
    logits_V = torch.randn(40, generator=torch.Generator().manual_seed(1)) * 3
    logits_V[[7, 11]] = torch.sort(logits_V, descending=True).values[2]  # the 3rd largest, twice
    naive_V = _naive_probs(logits_V, temperature, top_k)
    handed, multinomial = [], torch.multinomial
    monkeypatch.setattr(torch, "multinomial",
                        lambda p, n, generator: handed.append(p) or multinomial(p, n, generator=generator))
    generate._pick(logits_V, temperature, top_k, torch.Generator())
    torch.testing.assert_close(handed[0], naive_V, rtol=1e-12, atol=1e-300)
    monkeypatch.undo()
    generator, n = torch.Generator().manual_seed(0), 4000
    picks = torch.tensor([generate._pick(logits_V, temperature, top_k, generator) for _ in range(n)])
    freq_V = torch.bincount(picks, minlength=40).double() / n
    assert ((freq_V - naive_V).abs() <= 5 * (naive_V * (1 - naive_V) / n).sqrt() + 1e-12).all(), name


def test_sample_draws_as_a_naive_loop_of_full_forwards():
    """`sample` with its KV cache (a context of 6 tokens that the 4-token prompt and 10 new ones
    overrun, the window then re-read) against a loop that runs the whole window through the model
    for each token and draws from `_naive_probs` with the same seeded generator."""
    from moefold.generate import sample
    from test_hf_interop import randomize_ours

    cfg = load_config("tiny-qwen3", {"model.vocab_size": "300"})
    model = build_model(cfg, 300)
    randomize_ours(model, seed=3)
    model.eval()
    prompt, context, vocab = [5, 17, 250, 3], 6, 257  # rows 257.. of the padded vocabulary never drawn
    for temperature, top_k in [(0.8, 0), (1.5, 20)]:
        got = sample(model, prompt, 10, temperature, top_k, context, -1, torch.Generator().manual_seed(7), vocab)
        ids, generator = list(prompt), torch.Generator().manual_seed(7)
        with torch.no_grad():
            for _ in range(10):
                logits_V = model(torch.tensor([ids[-context:]]))[0, -1, :vocab].float()
                ids.append(int(torch.multinomial(_naive_probs(logits_V, temperature, top_k), 1, generator=generator)))
        assert got == ids[len(prompt):], (temperature, top_k)


def test_config_params_flop_line_states_the_counted_flops_and_active(capsys):
    """The FLOP line printed 0.00 GFLOP per token for the tiny presets (2.53 MFLOP counted); its
    active count holds the MTP modules, which the lines above leave out, and says so."""
    from moefold.cli import main
    from moefold.train.flops import train_flops_per_token

    cfg, hand = _counted(*MTP_SHARED)
    model = build_model(cfg, model_vocab_size(cfg))
    argv = [a for k, v in MTP_SHARED[1].items() for a in (f"--{k}", v)]
    assert main(["config", "params", "--config", MTP_SHARED[0], *argv]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("FLOP convention"))
    flops = re.search(r"([\d.]+) ([MG])FLOP per token", line)
    printed = float(flops.group(1)) * {"M": 1e6, "G": 1e9}[flops.group(2)]
    assert printed == pytest.approx(train_flops_per_token(model, cfg.train.seq_len), rel=0.01), line
    embedding = model.tok_embeddings.weight.numel()
    _assert_printed(line, ("FLOP convention",), [hand["active"] - embedding + hand["mtp_active"]])
    assert "MTP modules included" in line
