"""Layouts against one process where features meet that test_layouts.py does not combine: each
trains or validates a tiny model on gloo ranks and compares with the same config in one process."""

from pathlib import Path

import torch
from conftest import write_text_corpus
from layouts import GLOBAL_MICRO_BATCH, train, train_on_rank
from layouts import config as layout_config
from ranks import run_ranks

from moefold.config import load_config
from moefold.data.corpus import is_validation, validation_threshold
from moefold.train.trainer import Trainer

VAL_FRACTION = 0.3


def _config(corpus: Path, dp: int = 1, extra: dict[str, str] | None = None, **parallel):
    return load_config("tiny-qwen3", {
        "data.path": str(corpus), "train.seq_len": "16", "train.micro_batch_size": str(GLOBAL_MICRO_BATCH // dp),
        "train.steps": "4", "train.warmup_steps": "2", "train.val_every": "0", "data.val_fraction": "0",
        "train.device": "cpu", "logging.tensorboard": "false", "logging.progress_bar": "false",
        "logging.expert_load_heatmap": "false", "logging.log_every": "4", "checkpoint.save_at_end": "false",
        **{f"parallel.{k}": str(v) for k, v in parallel.items()}, **(extra or {})})


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
    one = Trainer(_config(corpus, extra=extra), tmp_path / "one", out=lambda line: None)
    assert [tuple(b.input_ids_BS.shape) for b in one.val_batches] == [(3, 15)]
    out = tmp_path / "val.pt"
    run_ranks(2, _validate_on_rank, _config(corpus, extra=extra, tp=2, sequence_parallel="false"),
              tmp_path / "tp2", out)
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
