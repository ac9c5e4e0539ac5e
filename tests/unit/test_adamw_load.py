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


ROUND_TRIPS = [OptimConfig(), OptimConfig(exp_avg_dtype="fp8", exp_avg_sq_dtype="fp8"),
               OptimConfig(master_dtype="bf16"), OptimConfig(exp_avg_dtype="bf16", master_dtype="bf16+remainder"),
               OptimConfig(exp_avg_dtype="fp8", exp_avg_sq_dtype="bf16", master_dtype="bf16+remainder"),
               OptimConfig(exp_avg_dtype="bf16", exp_avg_sq_dtype="fp8", master_dtype="bf16+remainder")]


@pytest.mark.parametrize("o", ROUND_TRIPS, ids=lambda o: f"{o.exp_avg_dtype}-{o.exp_avg_sq_dtype}-{o.master_dtype}")
def test_a_saved_and_loaded_optimizer_continues_bit_for_bit(o, tmp_path):
    """state_dict through a file, load_state_dict into a fresh optimizer of the same settings: the
    next steps equal the uninterrupted run's, parameters and every state in its own dtype."""
    def built():
        model = torch.nn.Sequential(torch.nn.Linear(200, 130), torch.nn.LayerNorm(130))  # blocks of 128: one short
        torch.manual_seed(0)
        for p in model.parameters():
            torch.nn.init.normal_(p)
        return model, build_optimizer(model, TrainConfig(lr=1e-2), torch.device("cpu"), o)

    def steps(model, opt, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(2):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
            opt.step()

    model, opt = built()
    steps(model, opt, seed=1)
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "saved.pt")
    steps(model, opt, seed=2)
    saved = torch.load(tmp_path / "saved.pt")
    resumed, resumed_opt = built()
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["optim"])
    steps(resumed, resumed_opt, seed=2)
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)
    for s, t in zip(opt.state.values(), resumed_opt.state.values(), strict=True):
        assert s.keys() == t.keys()
        for key in s:
            assert s[key].dtype == t[key].dtype and torch.equal(s[key].reshape(-1).view(torch.uint8),
                                                                t[key].reshape(-1).view(torch.uint8)), key
