"""Feature combinations under parallel layouts that test_layouts.py does not cover, each trained for
a few steps on gloo ranks against the single-process run of the same config (losses and gradient
norms to 1e-4 relative, as there)."""

import pytest
import torch
from conftest import write_text_corpus
from layouts import train, train_on_rank
from layouts import config as run_config
from ranks import run_ranks

LOSS_RTOL = 1e-4
STEPS = 5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_text_corpus(tmp_path_factory.mktemp("corpus"))


def _check_same_training(result: dict, ref: dict, note: str) -> None:
    for key in ("losses", "grad_norms"):
        torch.testing.assert_close(torch.tensor(result[key]), torch.tensor(ref[key]), rtol=LOSS_RTOL,
                                   atol=0, msg=lambda m, key=key: f"{note} {key}: {m}")


def test_router_jitter_under_sequence_and_data_parallelism_draws_as_one_process(corpus, tmp_path):
    """moe.input_jitter under tp2 (sequence-parallel: each rank routes its shard of every sequence)
    and ep2 (two data ranks): every token gets the noise one process gives it. Drawn from the RNG
    in the shape of the rank's own tokens, the noise was the same on every data rank and sequence
    shard (their RNGs are seeded alike), another draw than one process's: losses off by 3e-4 in 5
    steps, gradient norms by 3e-3."""
    extra = {"moe.input_jitter": "0.1", "train.steps": str(STEPS)}
    ref = train(run_config("qwen3", corpus, extra=extra), tmp_path / "ref")
    runs = [("tp2", "qwen3", corpus, 1, dict(tp=2), tmp_path / "tp2", None, 0, extra),
            ("ep2", "qwen3", corpus, 2, dict(ep=2), tmp_path / "ep2", None, 0, extra)]
    out = tmp_path / "results.pt"
    run_ranks(2, train_on_rank, runs, out)
    results = torch.load(out)
    for name in ("tp2", "ep2"):
        _check_same_training(results[name], ref, f"jitter {name}")


def test_padding_to_capacity_where_tp_ranks_split_the_routed_tokens(corpus, tmp_path):
    """moe.pad_to_capacity under tp2 where the router sees the TP group's whole batch and each TP
    rank dispatches its half (SequenceSplitDispatcher: without sequence parallelism, and in
    DeepSeek's MTP block with it): padding changes no result. The groups were padded to the
    capacity of the rank's half, though the drop kept up to the whole batch's C copies of an
    expert, all of which one half may hold: rows spilled into the next expert's group, or past
    the buffer (IndexError at the first step)."""
    capacity = {"moe.capacity_factor": "1.0", "train.steps": str(STEPS)}
    padded = {**capacity, "moe.pad_to_capacity": "true"}
    cases = [("qwen3", dict(tp=2, sequence_parallel="false")), ("deepseek", dict(tp=2))]
    runs = [(f"{model}-{name}", model, corpus, 1, parallel, tmp_path / f"{model}-{name}", None, 0, extra)
            for model, parallel in cases for name, extra in (("drop", capacity), ("pad", padded))]
    out = tmp_path / "results.pt"
    run_ranks(2, train_on_rank, runs, out)
    results = torch.load(out)
    for model, _ in cases:
        _check_same_training(results[f"{model}-pad"], results[f"{model}-drop"], f"pad to capacity {model}")
