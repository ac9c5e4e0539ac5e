"""Layouts no other test trains, against one process of the same config, seed and global batch: a
rank order other than the default, where the TP and ETP groups are different ranks, and a
checkpoint whose weights are split by TP and ETP (DTensors over the (ep, etp) mesh under FSDP)
resumed under other layouts and in one process.

Bounds, as test_folding_audit9.py's: losses and gradient norms to 1e-4 relative, first-step
gradients to 1e-5; the parameters and expert biases at the end within 2e-3 · lr of one process's
(Adam's step is about lr whatever the gradient's size, so reduction-order noise where a gradient
is near 0 moves a weight by a fraction of lr; a wrong reshard or a lost state moves it by O(lr)).
Measured here: at most 6.7e-4 · lr (deepseek, both tests) and 8.9e-4 · lr (qwen3), in the routed
experts' weights; losses 1e-7 relative.
"""

from pathlib import Path

import pytest
import torch
from conftest import write_text_corpus
from layouts import config as layout_config
from layouts import train as train_layout
from ranks import run_ranks
from torch.distributed.tensor import DTensor

from moefold.parallel.dims import ParallelDims, group_ranks

LOSS_RTOL = 1e-4
GRAD_TOL = dict(rtol=1e-5, atol=1e-5)
PARAM_ATOL_LR = 2e-3
STEPS = 4
# Balancing losses large enough that a router gradient summed over the wrong ranks shows, two
# micro-batches a step, and an expert bias that moves by O(0.1) a step.
BALANCED = {"train.steps": str(STEPS), "train.grad_accum": "2", "moe.seq_aux_loss_coeff": "1.0",
            "moe.aux_loss_coeff": "0.5", "moe.global_aux_loss_coeff": "0.5", "moe.z_loss_coeff": "0.1",
            "moe.expert_bias": "true", "moe.expert_bias_update_rate": "0.1"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_text_corpus(tmp_path_factory.mktemp("corpus"))


def _config(model: str, corpus: Path, dp: int, **parallel):
    return layout_config(model, corpus, dp, steps=STEPS, extra=BALANCED, **parallel)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and expert bias, whole (a collective for DTensors: call on all ranks)."""
    tensors = dict(model.named_parameters())
    tensors.update((name, b) for name, b in model.named_buffers() if name.endswith("expert_bias_E"))
    return {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
            for name, t in tensors.items()}


def train(cfg, run_dir: Path, resume: Path | None = None, save_at: int = 0) -> dict:
    """layouts.train's losses, gradient norms and first-step gradients, and the state at the end."""
    return train_layout(cfg, run_dir, resume, save_at,
                        finish=lambda trainer: {"state": _state(trainer.model), "lr": cfg.train.lr})


def _train_on_rank(rank: int, corpus: Path, runs: list, out: Path) -> None:
    """Each run: (name, model, dp, parallel sizes, run_dir, resume, save_at)."""
    results = {name: train(_config(model, corpus, dp, **parallel), run_dir, resume, save_at)
               for name, model, dp, parallel, run_dir, resume, save_at in runs}
    if rank == 0:
        torch.save(results, out)


def _check_losses(result: dict, ref: dict, note: str) -> None:
    done = len(ref["losses"]) - len(result["losses"])  # steps before a resume
    for key in ("losses", "grad_norms"):
        torch.testing.assert_close(torch.tensor(result[key]), torch.tensor(ref[key][done:]), rtol=LOSS_RTOL,
                                   atol=0, msg=lambda m, key=key: f"{note} {key}: {m}")


def _check_state(result: dict, ref: dict, note: str) -> None:
    assert result["state"].keys() == ref["state"].keys(), note
    for name, want in ref["state"].items():
        torch.testing.assert_close(result["state"][name], want, rtol=0, atol=PARAM_ATOL_LR * ref["lr"],
                                   msg=lambda m, name=name: f"{note} {name} after {STEPS} steps: {m}")


# (name, model, dp, parallel sizes) on 4 ranks. ep-tp-cp-dp-pp: attention TP over ranks {0,1},
# {2,3} (ep is 1 in the attention grid), experts' ETP over {0,2}, {1,3}, EP over {0,1}, {2,3}.
# dp-tp-cp-ep-pp: data ranks adjacent, TP over {0,2}, {1,3}.
ORDERS = [
    ("deepseek-ep-first-tp2-etp2-ep2", "deepseek", 2, dict(tp=2, etp=2, ep=2, order="ep-tp-cp-dp-pp")),
    ("qwen3-dp-first-tp2-ep2-no-sp-ddp", "qwen3", 2,
     dict(tp=2, ep=2, order="dp-tp-cp-ep-pp", sequence_parallel="false", data_parallel="ddp")),
]


def test_the_orders_put_tp_and_etp_on_other_ranks():
    dims = ParallelDims(4, tp=2, etp=2, ep=2, order="ep-tp-cp-dp-pp")
    assert group_ranks(dims, "tp") == [[0, 1], [2, 3]]
    assert group_ranks(dims, "etp") == [[0, 2], [1, 3]]
    assert group_ranks(ParallelDims(4, tp=2, ep=2, order="dp-tp-cp-ep-pp"), "tp") == [[0, 2], [1, 3]]


def test_layouts_in_another_rank_order_train_like_one_process(corpus, tmp_path):
    runs = [(name, model, dp, parallel, tmp_path / name, None, 0) for name, model, dp, parallel in ORDERS]
    run_ranks(4, _train_on_rank, corpus, runs, tmp_path / "orders.pt")
    results = torch.load(tmp_path / "orders.pt")
    for name, model, _, _ in ORDERS:
        ref = train(_config(model, corpus, 1), tmp_path / f"one-{name}")
        _check_losses(results[name], ref, name)
        for param, grad in ref["grads"].items():
            torch.testing.assert_close(results[name]["grads"][param], grad, **GRAD_TOL,
                                       msg=lambda m, param=param: f"{name} first-step grad {param}: {m}")
        _check_state(results[name], ref, name)


def test_a_checkpoint_split_by_tp_and_etp_resumes_under_other_layouts(corpus, tmp_path):
    """DeepSeek-V3 saved after 2 of 4 steps under tp2·etp2·ep2 (FSDP over dp 2: attention and
    shared-expert weights split by TP, routed experts by EP and ETP); resumed under etp2 with
    ZeRO-1, under ep2 with FSDP (2 ranks each) and in one process, each run ends where the
    uninterrupted one-process run ends: its last two losses, weights and expert biases."""
    saved = tmp_path / "tp2-etp2-ep2"
    run_ranks(4, _train_on_rank, corpus, [("saved", "deepseek", 2, dict(tp=2, etp=2, ep=2), saved, None, 2)],
              tmp_path / "saved.pt")
    checkpoint = saved / "checkpoints"
    resumes = [("etp2-ddp", "deepseek", 2, dict(etp=2, data_parallel="ddp"), tmp_path / "etp2", checkpoint, 0),
               ("ep2-fsdp", "deepseek", 2, dict(ep=2), tmp_path / "ep2", checkpoint, 0)]
    run_ranks(2, _train_on_rank, corpus, resumes, tmp_path / "resumed.pt")
    results = torch.load(tmp_path / "resumed.pt")
    results["one process"] = train(_config("deepseek", corpus, 1), tmp_path / "one-resumed", resume=checkpoint)
    results["saved"] = torch.load(tmp_path / "saved.pt")["saved"]
    ref = train(_config("deepseek", corpus, 1), tmp_path / "one")
    for name, result in results.items():
        assert len(result["losses"]) == (STEPS if name == "saved" else STEPS - 2), name
        _check_losses(result, ref, f"resumed {name}" if name != "saved" else name)
        _check_state(result, ref, f"resumed {name}" if name != "saved" else name)
