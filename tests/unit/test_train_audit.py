"""The training step against a naive loop of plain torch: torch.optim.AdamW with the documented
decay groups, the documented schedule written out here, clip_grad_norm_, gradient accumulation
as the mean over micro-batches, the MTP objective spelled out; and the trainer's own runs against
each other (grad_accum vs one larger micro-batch, recompute and offload vs none)."""

import copy
import dataclasses
import json
import math
import statistics
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_OVERRIDES
from memory_runs import one_thread  # noqa: F401 (autouse: ops this small run faster on one thread)

from moefold.config import MemoryConfig, TrainConfig, load_config
from moefold.data import IGNORE_INDEX
from moefold.models.mtp import shift_left
from moefold.models.transformer import build_model
from moefold.optim.schedule import build_scheduler
from moefold.train.trainer import Trainer


def tiny_config(corpus: Path, **overrides):
    return load_config(None, {**TINY_OVERRIDES, "data.path": str(corpus), "train.steps": "4",
                              **{key: str(value) for key, value in overrides.items()}})


def read_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line]


def documented_lr(step: int, *, lr: float, steps: int, warmup: int, min_ratio: float, schedule: str,
                  decay_fraction: float) -> float:
    """docs/optimizer.md's schedule, step counted from 0: lr/warmup at step 0 rising to lr at
    step warmup − 1; cosine from there to min_ratio · lr at steps − 1; wsd at the peak until its
    last round(decay_fraction · steps) steps (at least one, none in the warm-up), then linear."""
    if step < warmup:
        return lr * (step + 1) / warmup
    peak = max(warmup - 1, 0)
    if schedule == "constant" or steps - 1 <= peak:
        return lr
    if schedule == "cosine":
        t = (step - peak) / (steps - 1 - peak)
        return lr * (min_ratio + (1 - min_ratio) * (1 + math.cos(math.pi * t)) / 2)
    decay_steps = max(1, round(decay_fraction * steps))
    start = max(steps - 1 - decay_steps, peak)
    if step <= start:
        return lr
    return lr * (1 - (1 - min_ratio) * (step - start) / (steps - 1 - start))


def decays(name: str, p: torch.Tensor) -> bool:
    """docs/optimizer.md: every parameter of two or more dimensions but the token embedding."""
    return p.dim() >= 2 and not name.startswith("tok_embeddings")


def mtp_losses(model, h_BSD, input_ids_BS, labels_BS, cos, sin) -> list[torch.Tensor]:
    """DeepSeek-V3's MTP depths written out: depth k reads h of depth k − 1 and the embedding of
    the token k on, and predicts the label k on."""
    losses = []
    for k, module in enumerate(model.mtp.layers, start=1):
        emb_BSD = model.tok_embeddings(shift_left(input_ids_BS, k, fill=0))
        x_BSD = module.eh_proj(torch.cat([module.enorm(emb_BSD), module.hnorm(h_BSD)], dim=-1))
        h_BSD = module.block(x_BSD, cos, sin, None)
        logits_BSV = model.output(module.norm(h_BSD))
        targets_N = shift_left(labels_BS, k, IGNORE_INDEX).flatten()
        if (targets_N == IGNORE_INDEX).all():  # docs/python.md: a depth without targets adds 0
            losses.append(logits_BSV.sum() * 0)
            continue
        losses.append(F.cross_entropy(logits_BSV.flatten(0, 1), targets_N, ignore_index=IGNORE_INDEX))
    return losses


AUX_NAMES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "z_loss")


def balance(f_E: torch.Tensor, scores_TE: torch.Tensor) -> torch.Tensor:
    """Switch / GShard: E · Σ_e f_e · P_e, P_e the mean score of expert e."""
    return scores_TE.shape[-1] * (f_E * scores_TE.mean(dim=0)).sum()


class RouterLosses:
    """The balancing losses and z-loss of every MoE layer's forward (softmax router, top-k of the
    scores), written out from the layer's input as docs/metrics.md names them: the micro-batch's
    (Switch), each sequence's averaged (DeepSeek), the step's so far (f from every micro-batch of
    the step up to this one), mean logsumexp(logits)². The layers' own injection is turned off
    (aux_loss_scale 0); the objective adds these with the config's coefficients."""

    def __init__(self, model, coeffs: dict[str, float]):
        self.coeffs = {name: c for name, c in coeffs.items() if c > 0}
        self.total = torch.zeros(())  # Σ coeff · loss over the micro-batch's forwards
        self.logged: list[tuple[int, str, float]] = []  # (layer, name, value) of the step
        self.step_counts: dict[int, torch.Tensor] = {}  # layer → routed copies per expert this step
        self.step_tokens: dict[int, int] = {}  # layer → tokens routed this step
        for i, layer in enumerate(model.moe_layers()):
            layer.aux_loss_scale = 0.0
            layer.register_forward_pre_hook(lambda module, args, i=i: self._add(i, module, args[0]))

    def _add(self, i: int, layer, x_BSD: torch.Tensor) -> None:
        B, S, _ = x_BSD.shape
        logits_TE = F.linear(x_BSD.reshape(B * S, -1), layer.router.weight)
        scores_TE = logits_TE.softmax(dim=-1)
        T, E = scores_TE.shape
        K = layer.top_k
        idx_TK = scores_TE.topk(K, dim=-1).indices
        counts_TE = torch.zeros(T, E).scatter_add_(1, idx_TK, torch.ones(T, K))
        self.step_counts[i] = self.step_counts.get(i, 0) + counts_TE.sum(dim=0)
        self.step_tokens[i] = self.step_tokens.get(i, 0) + T
        counts_BSE, scores_BSE = counts_TE.view(B, S, E), scores_TE.view(B, S, E)
        losses = {"aux_loss": balance(counts_TE.sum(dim=0) / (T * K), scores_TE),
                  "seq_aux_loss": torch.stack([balance(counts_BSE[b].sum(dim=0) / (S * K), scores_BSE[b])
                                               for b in range(B)]).mean(),
                  "global_aux_loss": balance(self.step_counts[i] / (self.step_tokens[i] * K), scores_TE),
                  "z_loss": logits_TE.logsumexp(dim=-1).square().mean()}
        for name, coeff in self.coeffs.items():
            self.total = self.total + coeff * losses[name]
            self.logged.append((i, name, losses[name].item()))

    def pop_total(self) -> torch.Tensor:
        total, self.total = self.total, torch.zeros(())
        return total

    def end_step(self) -> dict[str, float]:
        """Each loss's mean over layers of each layer's mean over its forwards (docs/metrics.md)."""
        means = {}
        for name in self.coeffs:
            layers = sorted({i for i, n, _ in self.logged if n == name})
            per_layer = [statistics.fmean(v for j, n, v in self.logged if j == i and n == name) for i in layers]
            means[name] = statistics.fmean(per_layer)
        self.logged, self.step_counts, self.step_tokens = [], {}, {}
        return means


def naive_run(trainer: Trainer, loader) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """The trainer's run in a plain loop over a copy of its model as built and of its loader:
    (final weights, per step {loss, grad_norm, lr, mtp_loss, and each router loss enabled})."""
    cfg, t = trainer.cfg, trainer.cfg.train
    # Built again, plain: a deep copy of a compiled or recomputing model would call the original's
    # wrapped forward (an instance attribute bound to it).
    model = build_model(dataclasses.replace(cfg, memory=MemoryConfig()), trainer.vocab_size)
    model.init_weights(seed=t.seed)
    for (name, p), (_, q) in zip(model.named_parameters(), trainer.model.named_parameters(), strict=True):
        assert torch.equal(p, q), f"{name} starts elsewhere than the trainer's"
    accum = t.grad_accum
    router_losses = RouterLosses(model, {name: getattr(cfg.moe, f"{name}_coeff") for name in AUX_NAMES})
    named = list(model.named_parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for n, p in named if decays(n, p)], "weight_decay": t.weight_decay},
         {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0}],
        lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, foreach=False)
    records = []
    for step in range(t.steps):
        lr = documented_lr(step, lr=t.lr, steps=t.steps, warmup=t.warmup_steps, min_ratio=t.min_lr_ratio,
                           schedule=t.schedule, decay_fraction=t.decay_fraction)
        for group in optimizer.param_groups:
            group["lr"] = lr
        lm_sum, mtp_sum = 0.0, 0.0
        for _ in range(accum):
            batch = loader.next_batch()
            h_BSD, (cos, sin) = model.trunk(batch.input_ids_BS)
            logits_BSV = model.output(model.norm(h_BSD))
            lm = F.cross_entropy(logits_BSV.flatten(0, 1), batch.labels_BS.flatten(), ignore_index=IGNORE_INDEX)
            total = lm
            if model.mtp is not None:
                mtp = torch.stack(mtp_losses(model, h_BSD, batch.input_ids_BS, batch.labels_BS, cos, sin)).mean()
                total = lm + cfg.model.mtp_loss_weight * mtp
                mtp_sum += mtp.item() / accum
            total = total + router_losses.pop_total()
            (total / accum).backward()
            lm_sum += lm.item() / accum
        max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
        optimizer.step()
        model.on_optimizer_step()
        optimizer.zero_grad(set_to_none=True)
        records.append({"loss": lm_sum, "grad_norm": grad_norm, "lr": lr, "mtp_loss": mtp_sum,
                        **router_losses.end_step()})
    return {n: p.detach() for n, p in model.named_parameters()}, records


def log_windows(per_step: list[dict], log_every: int) -> list[dict]:
    """docs/metrics.md: every log_every steps (and the last) the mean of the steps since the
    previous log step; lr is the last step's."""
    logged, window = [], []
    for step, record in enumerate(per_step, start=1):
        window.append(record)
        if step % log_every == 0 or step == len(per_step):
            mean = {key: sum(r[key] for r in window) / len(window) for key in record}
            logged.append({**mean, "step": step, "lr": record["lr"]})
            window = []
    return logged


def assert_matches_naive(trainer: Trainer, run_dir: Path) -> None:
    loader = copy.deepcopy(trainer.train_loader)
    expected_weights, per_step = naive_run(trainer, loader)
    expected = log_windows(per_step, trainer.cfg.logging.log_every)
    trainer.fit()
    got = read_records(run_dir)
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for g, e in zip(got, expected, strict=True):
        step = e["step"]
        assert g["lr"] == pytest.approx(e["lr"], rel=1e-12), f"lr at step {step}"
        assert g["loss"] == pytest.approx(e["loss"], rel=1e-5), f"loss at step {step}"
        assert g["grad_norm"] == pytest.approx(e["grad_norm"], rel=1e-4), f"grad_norm at step {step}"
        for name in AUX_NAMES:
            assert g.get(name) == pytest.approx(e.get(name), rel=1e-5), f"{name} at step {step}"
        if "mtp_loss" in g:
            assert g["mtp_loss"] == pytest.approx(e["mtp_loss"], rel=1e-5), f"mtp_loss at step {step}"
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(p.detach(), expected_weights[name], rtol=1e-4, atol=2e-5, msg=name)


@pytest.mark.parametrize("overrides", [
    {},
    {"train.grad_accum": 3, "train.micro_batch_size": 2},
    {"train.grad_clip": 0.05, "train.schedule": "wsd", "train.decay_fraction": 0.5},
    {"train.grad_clip": 0, "train.warmup_steps": 0, "train.schedule": "cosine"},
    {"train.schedule": "constant", "train.warmup_steps": 3, "train.weight_decay": 0.5},
    {"model.mtp_layers": 2, "model.mtp_loss_weight": 0.5, "train.grad_accum": 2, "train.micro_batch_size": 2},
    {"model.tie_embeddings": "true", "train.weight_decay": 0.5, "train.lr": 1e-2},
    {"train.loss_chunk_tokens": 24, "model.mtp_layers": 1, "model.tie_embeddings": "true", "train.grad_accum": 2,
     "train.micro_batch_size": 2},
    {"logging.log_every": 3, "train.steps": 7, "model.mtp_layers": 1, "train.grad_clip": 0.05},
    {"moe.seq_aux_loss_coeff": 0.1, "moe.global_aux_loss_coeff": 0.1, "moe.z_loss_coeff": 0.01,
     "train.grad_accum": 3, "train.micro_batch_size": 2, "model.mtp_layers": 1},
    {"train.seq_len": 2, "model.mtp_layers": 3, "train.loss_chunk_tokens": 5, "train.grad_accum": 2,
     "train.micro_batch_size": 2},
], ids=["default", "accum3", "clipped-wsd", "no-clip-no-warmup", "constant-decay", "mtp-accum", "tied",
        "chunked-mtp-tied", "log-windows", "every-router-loss", "mtp-depths-without-targets"])
def test_a_run_matches_a_naive_torch_loop(tmp_path, text_corpus, overrides):
    """Loss, grad_norm, lr, mtp_loss and the router losses of every log window and the final
    weights equal those of a plain loop: torch.optim.AdamW over the documented decay groups, the
    documented schedule, clip_grad_norm_ (off at 0), each micro-batch's loss divided by grad_accum,
    MTP as lm + weight · mean of depths, the router losses written out and added with their
    coefficients (the layers' own injection off)."""
    cfg = tiny_config(text_corpus, **{"moe.aux_loss_coeff": 0.1, **overrides})
    run = tmp_path / "run"
    assert_matches_naive(Trainer(cfg, run, out=lambda line: None), run)


def final_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


LOGGED = ("loss", "grad_norm", "lr", "mtp_loss", "seq_aux_loss", "z_loss", "load_imbalance", "routing_entropy")


@pytest.mark.parametrize("accum, micro_batch", [(2, 2), (4, 1)])
def test_accumulated_micro_batches_train_as_one_micro_batch_of_them_all(tmp_path, text_corpus, accum, micro_batch):
    """grad_accum micro-batches of B sequences step as one micro-batch of grad_accum · B (the same
    sequences, in the same order): the losses whose value is a mean over sequences or tokens
    (next-token, MTP, DeepSeek's per-sequence balance, z-loss) and the expert-bias update from the
    step's counts. (The micro-batch and global-batch balance losses are per micro-batch by design.)"""
    common = {"moe.aux_loss_coeff": 0, "moe.seq_aux_loss_coeff": 0.1, "moe.z_loss_coeff": 0.01,
              "moe.score_func": "sigmoid", "moe.expert_bias": "true", "moe.expert_bias_update_rate": 0.01,
              "model.mtp_layers": 1, "train.grad_clip": 0.5}
    runs = {}
    for name, shape in (("one", {"train.grad_accum": 1, "train.micro_batch_size": 4}),
                        ("accumulated", {"train.grad_accum": accum, "train.micro_batch_size": micro_batch})):
        trainer = Trainer(tiny_config(text_corpus, **common, **shape), tmp_path / name, out=lambda line: None)
        trainer.fit()
        biases = [layer.router.expert_bias_E.clone() for layer in trainer.model.moe_layers()]
        runs[name] = (final_weights(trainer), biases, read_records(tmp_path / name))
    (weights, biases, records), (weights_acc, biases_acc, records_acc) = runs["one"], runs["accumulated"]
    for r, r_acc in zip(records, records_acc, strict=True):
        for key in LOGGED:
            assert r_acc[key] == pytest.approx(r[key], rel=1e-5), f"{key} at step {r['step']}"
    for b, b_acc in zip(biases, biases_acc, strict=True):
        torch.testing.assert_close(b_acc, b)
    for name, p in weights.items():
        torch.testing.assert_close(weights_acc[name], p, rtol=1e-4, atol=2e-5, msg=name)


@pytest.mark.parametrize("memory", [
    {"memory.recompute": '["layer"]'},
    {"memory.recompute": '["moe", "norm"]', "memory.offload": '["attn_core"]'},
    {"memory.offload": '["moe", "norm"]'},
    {"memory.recompute": '["moe_act", "attn_core"]', "memory.offload": '["layer"]'},
], ids=["recompute-layer", "recompute-moe-offload-attn", "offload-moe", "recompute-inside-offload"])
def test_recompute_and_offload_train_as_keeping_every_activation(tmp_path, text_corpus, memory):
    """memory.recompute and memory.offload change where activations live, never the run: through
    the trainer (accumulation, MTP blocks, aux losses, expert bias, clipping), the same logged
    values and final weights, bit for bit, as with neither."""
    common = {"moe.seq_aux_loss_coeff": 0.1, "moe.z_loss_coeff": 0.01, "moe.score_func": "sigmoid",
              "moe.expert_bias": "true", "model.mtp_layers": 1, "train.grad_accum": 2,
              "train.micro_batch_size": 2, "train.grad_clip": 0.5, "train.steps": 3}
    if "memory.offload" in memory:  # else refused, as without effect
        memory = {**memory, "memory.offload_min_bytes": 0}
    runs = {}
    for name, extra in (("none", {}), ("memory", memory)):
        trainer = Trainer(tiny_config(text_corpus, **common, **extra), tmp_path / name, out=lambda line: None)
        trainer.fit()
        records = [{k: v for k, v in r.items() if k in LOGGED or k == "aux_loss"}
                   for r in read_records(tmp_path / name)]
        runs[name] = (final_weights(trainer), records)
    assert runs["memory"][1] == runs["none"][1]
    for name, p in runs["none"][0].items():
        assert torch.equal(runs["memory"][0][name], p), name


def test_throughput_counts_every_micro_batch_of_the_step(tmp_path, text_corpus, monkeypatch):
    """On a clock that moves 1 s per training step only, tokens_per_s is the global batch's tokens
    (global_batch_size · seq_len, grad_accum derived from it), tflops their FLOPs by
    docs/metrics.md's convention counted here from the parameters, and mfu over
    logging.peak_tflops (on the CPU too)."""
    import types

    import moefold.train.trainer as trainer_module

    clock = [0.0]
    monkeypatch.setattr(trainer_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    step = Trainer.train_step

    def timed_step(self):
        out = step(self)
        clock[0] += 1.0
        return out

    monkeypatch.setattr(Trainer, "train_step", timed_step)
    cfg = tiny_config(text_corpus, **{"train.global_batch_size": 12, "train.micro_batch_size": 2,
                                      "model.mtp_layers": 1, "logging.log_every": 2, "logging.peak_tflops": 1e-4})
    trainer = Trainer(cfg, tmp_path / "run", out=lambda line: None)
    assert trainer.grad_accum == 6
    m, moe = cfg.model, cfg.moe
    active = 0
    for name, p in trainer.model.named_parameters():  # the embedding lookup is no matmul
        if name.startswith("tok_embeddings"):
            continue
        active += p.numel() * moe.top_k / moe.num_experts if "experts." in name else p.numel()
    head_dim = m.dim // m.n_heads
    flops_per_token = (6 * active + 6 * m.mtp_layers * trainer.model.output.weight.numel()
                       + 3 * (m.n_layers + m.mtp_layers) * cfg.train.seq_len * m.n_heads * 2 * head_dim)
    trainer.fit()
    records = read_records(tmp_path / "run")
    tokens_per_s = 12 * cfg.train.seq_len
    for r in records:
        assert r["tokens_per_s"] == tokens_per_s
        assert r["tflops"] == pytest.approx(tokens_per_s * flops_per_token / 1e12, rel=1e-6)
        assert r["mfu"] == pytest.approx(r["tflops"] / 1e-4)


def test_a_schedule_built_steps_in_starts_from_the_config_lr():
    """build_scheduler(optimizer, t, steps_done) is the config's schedule at that step, its peak
    train.lr (as its docstring says), whatever lr the optimizer was built with: an optimizer no
    schedule had stepped ended in torch's KeyError ('initial_lr' is not specified)."""
    t = TrainConfig(steps=10, warmup_steps=2, lr=2e-3, min_lr_ratio=0.1, schedule="cosine")
    for built_with in (2e-3, 5e-1):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=built_with)
        build_scheduler(optimizer, t, steps_done=5)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(
            documented_lr(5, lr=2e-3, steps=10, warmup=2, min_ratio=0.1, schedule="cosine", decay_fraction=0.2))


@pytest.mark.parametrize("memory", [{"memory.recompute": '["layer"]'}, {"memory.recompute": '["norm", "moe_act"]'},
                                    {"memory.offload": '["moe"]'}])
def test_a_model_whose_forwards_memory_wraps_is_not_deep_copied_into_the_original(memory):
    """A recomputed or offloaded site is an instance attribute wrapping the original module's bound
    method, which copy.deepcopy keeps as it is: the copy (an EMA, torch's AveragedModel, a
    reference model) ran the original's weights, and its backward trained the original while its
    own parameters got no gradient, silently (a recomputed expert activation: a RecursionError).
    It is refused in one line naming the options."""
    cfg = load_config("tiny", {"model.n_layers": "2", "model.dim": "32", "model.n_heads": "2",
                               "model.n_kv_heads": "1", **memory})
    model = build_model(cfg, 64)
    for module in (model, model.layers[1]):
        with pytest.raises(TypeError, match=r"^cannot deep-copy a model built with memory\.recompute or "
                                            r"memory\.offload: "):
            copy.deepcopy(module)
    plain = build_model(load_config("tiny", {"model.n_layers": "2"}), 64)
    copied = copy.deepcopy(plain)  # without them a copy is its own model
    assert all(p is not q for p, q in zip(plain.parameters(), copied.parameters()))
