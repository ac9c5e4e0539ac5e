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
