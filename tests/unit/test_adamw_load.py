"""The all-fp32 AdamW (torch's, built by build_optimizer) keeps this process's implementation when
a checkpoint loads: torch's load_state_dict puts back the saver's `fused` and `foreach` with the
hyperparameters, so a GPU run (fused, the clip coefficient handed to the kernel) resumed from a CPU
run's checkpoint stepped with foreach, which refuses that coefficient (AssertionError at the first
step), and a CPU run resumed from a GPU one switched kernels. torch's fused AdamW also runs on the
CPU, which stands in for the GPU here."""

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from moefold.config import OptimConfig, TrainConfig
from moefold.optim.adamw import build_optimizer, clip_scaling
from moefold.parallel.data import GradNormClipper


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))


def _train(model, opt, clip, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        clip(0.5)
        opt.step()


def _implementation(opt) -> list[tuple]:
    return [(g["fused"], g["foreach"]) for g in opt.param_groups]


@pytest.mark.parametrize("saver, loader", [("cpu", "cuda"), ("cuda", "cpu")])
def test_a_loaded_checkpoint_keeps_the_loaders_kernel(saver, loader):
    t = TrainConfig()
    saved_model = _model()
    saved = build_optimizer(saved_model, t, torch.device(saver))
    _train(saved_model, saved, GradNormClipper(list(saved_model.parameters()), None,
                                               clip_scaling(saved, OptimConfig())), 2, seed=1)
    state = get_optimizer_state_dict(saved_model, saved)

    model = _model()
    model.load_state_dict(saved_model.state_dict())
    opt = build_optimizer(model, t, torch.device(loader))
    chosen = _implementation(opt)
    clip = GradNormClipper(list(model.parameters()), None, clip_scaling(opt, OptimConfig()))
    set_optimizer_state_dict(model, opt, state)  # as the trainer resumes (optimizer.load_state_dict)
    assert _implementation(opt) == chosen
    assert all(torch.equal(opt.state[p]["step"], torch.tensor(2.0)) for p in model.parameters())
    _train(model, opt, clip, 2, seed=2)  # fused: the clip coefficient goes to the kernel

