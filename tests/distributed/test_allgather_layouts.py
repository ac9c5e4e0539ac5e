"""The all-gather dispatcher over an EP group that is not the whole world (tp2·ep2 folded, with and
without sequence parallelism, and ep2 over edp2): 4 gloo ranks train tiny Qwen3-MoE and
DeepSeek-V3 models for 3 steps like one process (losses and gradient norms to 1e-4 relative, the
first step's gradients to 1e-5, as test_layouts.py). Through torch.distributed.nn.functional's
all-gather, whose backward on gloo gives its scatters group ranks where torch takes global ones,
the first backward failed on the group of ranks 2 and 3 ("Global rank 0 is not part of group")."""

import pytest
import torch
from conftest import write_text_corpus
from layouts import train, train_on_rank
from layouts import config as run_config
from ranks import run_ranks

LOSS_RTOL = 1e-4
GRAD_TOL = dict(rtol=1e-5, atol=1e-5)
STEPS = {"train.steps": "3"}

# (run name, model, dp, parallel sizes), all on 4 ranks
RUNS = [
    ("qwen3-tp2-ep2", "qwen3", 2, dict(tp=2, ep=2)),
    ("qwen3-tp2-ep2-no-sp", "qwen3", 2, dict(tp=2, ep=2, sequence_parallel="false")),
    ("qwen3-ep2-edp2", "qwen3", 4, dict(ep=2)),
    ("deepseek-tp2-ep2", "deepseek", 2, dict(tp=2, ep=2)),
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_text_corpus(tmp_path_factory.mktemp("corpus"))


def test_allgather_dispatch_over_a_subgroup_trains_like_one_process(corpus, tmp_path):
    refs = {m: train(run_config(m, corpus, extra=STEPS), tmp_path / f"ref-{m}") for m in ("qwen3", "deepseek")}
    out = tmp_path / "results.pt"
    run_ranks(4, train_on_rank, [(name, model, corpus, dp, {**parallel, "ep_dispatcher": "allgather"},
                                  tmp_path / name, None, 0, STEPS) for name, model, dp, parallel in RUNS], out)
    results = torch.load(out)
    for name, model, _, _ in RUNS:
        result, ref = results[name], refs[model]
        assert len(result["losses"]) == 3, name
        for key in ("losses", "grad_norms"):
            torch.testing.assert_close(torch.tensor(result[key]), torch.tensor(ref[key]), rtol=LOSS_RTOL,
                                       atol=0, msg=lambda m, key=key, name=name: f"{name} {key}: {m}")
        for param, grad in ref["grads"].items():
            torch.testing.assert_close(result["grads"][param], grad, **GRAD_TOL,
                                       msg=lambda m, p=param, name=name: f"{name} first-step grad {p}: {m}")
