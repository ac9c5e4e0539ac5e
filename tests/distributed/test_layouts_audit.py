"""Layouts against one process where features meet that test_layouts.py does not combine: each
trains or validates a tiny model on gloo ranks and compares with the same config in one process."""

from pathlib import Path

import torch
from conftest import write_text_corpus
from layouts import assert_records_close, fit_on_rank, logged_records, train, train_on_rank
from layouts import config as layout_config
from ranks import run_ranks

from moefold.data.corpus import is_validation, validation_threshold
from moefold.train.trainer import Trainer

VAL_FRACTION = 0.3


def _corpus_with_a_short_validation_file(root: Path, val_bytes: int) -> Path:
    """Training files of 80 words, and one validation file (the first name data.val_fraction
    holds out) of `val_bytes` bytes: with the byte tokenizer, val_bytes + 1 tokens."""
    root.mkdir(parents=True)
    threshold = validation_threshold(VAL_FRACTION)
    names = [f"t{i}.txt" for i in range(30)]
    val_name = next(name for name in names if is_validation(name, threshold))
    for i, name in enumerate(names):
        if name == val_name:
            (root / name).write_text(("abcdefghij" * 10)[:val_bytes])
        elif not is_validation(name, threshold):
            (root / name).write_text(" ".join(f"w{(i * 7 + j * 13) % 97}" for j in range(80)))
    return root


def _validate_on_rank(rank: int, cfg, run_dir: Path, out: Path) -> None:
    val_loss = Trainer(cfg, run_dir, out=lambda line: None).validate()
    if rank == 0:
        torch.save(val_loss, out)


def test_validation_under_tp_without_sequence_parallelism_takes_any_number_of_rows(tmp_path):
    """Without sequence parallelism the TP ranks split a micro-batch's tokens for the routed
    experts; training's micro-batch is checked to split, but a small validation set's one batch
    holds what there is: 3 sequences of 15 tokens, 45 tokens over tp 2. That stopped the run at
    its first validation ('parallel.tp=2 does not divide the 45 tokens of a micro-batch
    (train.micro_batch_size · train.seq_len)', which are 60); a padding row (no labels, no expert)
    now evens it out, and the loss is one process's."""
    corpus = _corpus_with_a_short_validation_file(tmp_path / "corpus", val_bytes=46)  # 3 sequences
    extra = {"data.val_fraction": str(VAL_FRACTION), "train.seq_len": "15"}
    one = Trainer(layout_config("qwen3", corpus, extra=extra), tmp_path / "one", out=lambda line: None)
    assert [tuple(b.input_ids_BS.shape) for b in one.val_batches] == [(3, 15)]
    out = tmp_path / "val.pt"
    tp2 = layout_config("qwen3", corpus, extra=extra, tp=2, sequence_parallel="false")
    run_ranks(2, _validate_on_rank, tp2, tmp_path / "tp2", out)
    torch.testing.assert_close(torch.load(out), one.validate(), rtol=1e-5, atol=0)


def _check_same_training(result: dict, ref: dict, note: str) -> None:
    for key in ("losses", "grad_norms"):
        torch.testing.assert_close(torch.tensor(result[key]), torch.tensor(ref[key]), rtol=1e-4, atol=0,
                                   msg=lambda m, key=key: f"{note} {key}: {m}")


def test_round_robin_routing_sends_each_token_where_one_process_does(tmp_path):
    """moe.force_balanced (benchmarks) gives the token at place t experts (t·K + k) mod E. Taken
    from the token's place among the rank's own tokens, a data rank's (32 tokens · 2 copies over 6
    experts) or a sequence shard's tokens went to other experts than in one process: losses off
    by 4e-4 in 4 steps under ep2 (two data ranks) and tp2 (sequence-parallel). The place is now
    the token's in the global micro-batch, as for the router's jitter."""
    corpus = write_text_corpus(tmp_path / "corpus")
    extra = {"moe.force_balanced": "true", "moe.num_experts": "6", "train.steps": "4"}
    ref = train(layout_config("qwen3", corpus, extra=extra), tmp_path / "ref")
    runs = [(name, "qwen3", corpus, dp, parallel, tmp_path / name, None, 0, extra)
            for name, dp, parallel in (("ep2", 2, dict(ep=2)), ("tp2", 1, dict(tp=2)))]
    out = tmp_path / "results.pt"
    run_ranks(2, train_on_rank, runs, out)
    results = torch.load(out)
    for name in ("ep2", "tp2"):
        _check_same_training(results[name], ref, f"force_balanced {name}")


ACCUMULATED_BALANCING = {"train.grad_accum": "2", "moe.global_aux_loss_coeff": "0.1",
                         "moe.z_loss_coeff": "0.01", "moe.expert_bias_update_rate": "0.1", "train.steps": "4"}


def test_balancing_accumulated_over_micro_batches_trains_like_one_process(tmp_path):
    """DeepSeek-V3 (sequence aux loss, expert bias) with the global-batch aux loss and the z-loss,
    two micro-batches a step: the global loss's counts accumulate over the step's micro-batches
    and the expert bias moves once a step, both from the global batch's counts — summed over the
    data ranks (ep2) or over the sequence shards (tp2; without sequence parallelism, see the
    next test). Every step's loss and gradient norm are one process's."""
    corpus = write_text_corpus(tmp_path / "corpus")
    ref = train(layout_config("deepseek", corpus, extra=ACCUMULATED_BALANCING), tmp_path / "ref")
    layouts = (("ep2", 2, dict(ep=2)), ("tp2", 1, dict(tp=2)))
    runs = [(name, "deepseek", corpus, dp, parallel, tmp_path / name, None, 0, ACCUMULATED_BALANCING)
            for name, dp, parallel in layouts]
    out = tmp_path / "results.pt"
    run_ranks(2, train_on_rank, runs, out)
    results = torch.load(out)
    for name, _, _ in layouts:
        _check_same_training(results[name], ref, f"accumulated balancing {name}")


def test_every_logged_value_under_tp_without_sequence_parallelism_is_one_process(tmp_path):
    """What a run logs under tp2 without sequence parallelism (the router, the capacity limit and
    the statistics see the TP group's whole batch; each rank dispatches half of it), with a
    capacity factor that drops copies, the global-batch aux loss and MTP: every value of every
    record — losses, mtp_loss, gradient norm, each aux loss per layer, load imbalance, entropy,
    dropped fraction and val_loss — is one process's (1e-4 relative)."""
    corpus = write_text_corpus(tmp_path / "corpus")
    extra = {**ACCUMULATED_BALANCING, "moe.capacity_factor": "1.0", "logging.log_every": "2",
             "train.val_every": "2", "data.val_fraction": "0.2", "train.val_batches": "2"}
    Trainer(layout_config("deepseek", corpus, extra=extra), tmp_path / "one", out=lambda line: None).fit()
    tp2 = layout_config("deepseek", corpus, extra=extra, tp=2, sequence_parallel="false")
    run_ranks(2, fit_on_rank, tp2, tmp_path / "tp2")
    one, tp2 = logged_records(tmp_path / "one"), logged_records(tmp_path / "tp2")
    assert [sorted(r) for r in tp2] == [sorted(r) for r in one]
    assert any("val_loss" in r for r in one) and any(r.get("dropped_fraction", 0) > 0 for r in one)
    assert_records_close(tp2, one)
