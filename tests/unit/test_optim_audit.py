"""Edges of the optimizers found in an audit, each against what torch.optim.AdamW or the docs
(docs/optimizer.md) promise. The meta device stands in for CUDA where a state's device matters:
a CPU-only machine has no other device than the CPU."""

import pytest
import torch

from moefold.config import TrainConfig
from moefold.optim import precision
from moefold.optim.adamw import AdamW, build_optimizer, param_groups
from moefold.optim.precision import PrecisionAwareAdamW


def test_a_loaded_precision_adamw_keeps_its_step_counts_on_the_cpu(monkeypatch):
    """The step counts are CPU tensors, read by .item() each step without a device sync. torch's
    load_state_dict moves them to the parameter's device when the saver's group says fused (a
    GPU run's checkpoint): every GPU resume then synced once per parameter and step."""
    monkeypatch.setattr(precision, "triton_available", lambda: True)
    saver_p = torch.nn.Parameter(torch.randn(4, 3))
    saver = PrecisionAwareAdamW([saver_p], exp_avg_dtype="bf16", fused=True)
    saver.state[saver_p]["step"] += 7
    p = torch.nn.Parameter(torch.zeros(4, 3, device="meta"))  # a parameter off the CPU
    loader = PrecisionAwareAdamW([p], exp_avg_dtype="bf16")
    loader.load_state_dict(saver.state_dict())
    step = loader.state[p]["step"]
    assert step.device == torch.device("cpu") and step.dtype == torch.float32 and step.item() == 7.0
    assert step is not saver.state[saver_p]["step"]  # a copy: the two optimizers count alone
    assert loader.state[p]["exp_avg"].device == p.device


def test_a_fused_adamw_loads_a_foreach_runs_step_counts_onto_its_parameters_device():
    """A CPU run's checkpoint (foreach AdamW: step counts on the CPU) resumed by a GPU run (fused):
    torch's load keeps a foreach saver's counts where they were, on the CPU, and torch's fused
    CUDA kernel dereferences each count's pointer on the device. They now move to the parameter's
    device, as torch's own load does when the saver was fused; a fused CPU loader keeps them."""
    saver_model = torch.nn.Linear(3, 4)
    saver = build_optimizer(saver_model, TrainConfig(), torch.device("cpu"))  # foreach
    for p in saver_model.parameters():
        p.grad = torch.ones_like(p)
    saver.step()
    for device in ("meta", "cpu"):  # meta: a device that is not the CPU
        model = torch.nn.Linear(3, 4, device=device)
        loader = AdamW(param_groups(model, 0.1), fused=True)  # as build_optimizer's groups
        loader.load_state_dict(saver.state_dict())
        for p in model.parameters():
            step = loader.state[p]["step"]
            assert step.device == p.device and step.dtype == torch.float32, device
        assert [g["fused"] for g in loader.param_groups] == [True, True]
    assert all(s["step"].device.type == "cpu" for s in saver.state.values())  # the saver's stay


@pytest.mark.parametrize("options", [{"betas": (0.9, 1.0)}, {"betas": (1.0, 0.95)}, {"betas": (-0.1, 0.95)},
                                     {"lr": -1e-3}, {"lr": float("nan")}, {"eps": -1e-8},
                                     {"weight_decay": -0.1}])
def test_precision_adamw_refuses_what_torch_adamw_refuses(options):
    """beta2 = 1 made every weight NaN at the first step (a zero bias correction), beta1 = 1 a
    ZeroDivisionError, a negative lr stepped uphill: torch.optim.AdamW refuses each when built.
    Refused before any parameter is recast."""
    with pytest.raises(ValueError):
        torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], **options)
    p = torch.nn.Parameter(torch.ones(3))
    name = next(iter(options))
    with pytest.raises(ValueError, match=rf"^{name}.*=.*; allowed: "):
        PrecisionAwareAdamW([p], master="bf16", **options)
    assert p.dtype == torch.float32


def test_precision_adamw_takes_the_edges_torch_adamw_takes():
    """lr 0, beta 0, eps 0 and weight decay 0: accepted, and lr 0 leaves the weights alone."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = PrecisionAwareAdamW([p], lr=0.0, betas=(0.0, 0.0), eps=0.0, weight_decay=0.0, exp_avg_dtype="bf16")
    p.grad = torch.full((3,), 2.0)
    opt.step()
    assert torch.equal(p.detach(), torch.ones(3))


@pytest.mark.parametrize("options", [{}, {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "bf16",
                                          "master": "bf16+remainder"}])
def test_a_param_group_added_later_steps_as_one_given_when_built(options):
    """torch's add_param_group (unfreezing a part later, say): the new group's states were never
    made, and the next step raised KeyError: 'step'. It now steps bit for bit as the same groups
    given when the optimizer is built."""
    gen = torch.Generator().manual_seed(0)
    a_0, b_0 = torch.randn(3, generator=gen), torch.randn(2, 130, generator=gen)
    later = [torch.nn.Parameter(a_0.clone()), torch.nn.Parameter(b_0.clone())]
    built = [torch.nn.Parameter(a_0.clone()), torch.nn.Parameter(b_0.clone())]
    opt_later = PrecisionAwareAdamW([later[0]], lr=1e-2, weight_decay=0.0, **options)
    opt_later.add_param_group({"params": [later[1]], "weight_decay": 0.1})
    opt_built = PrecisionAwareAdamW([{"params": [built[0]], "weight_decay": 0.0},
                                     {"params": [built[1]], "weight_decay": 0.1}], lr=1e-2, **options)
    assert later[1].dtype == built[1].dtype
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen) for p in later]
        for params, opt in ((later, opt_later), (built, opt_built)):
            for p, g in zip(params, grads):
                p.grad = g.to(p.dtype)
            opt.step()
    for p, q in zip(later, built):
        assert torch.equal(p, q)
    for s, t in zip(opt_later.state.values(), opt_built.state.values(), strict=True):
        assert s.keys() == t.keys() and all(torch.equal(s[k].float(), t[k].float()) for k in s)


def test_a_param_group_added_later_with_a_bad_option_is_not_added():
    opt = PrecisionAwareAdamW([torch.nn.Parameter(torch.ones(3))])
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match=r"^exp_avg_dtype='fp16'; allowed: fp32, bf16, fp8$"):
        opt.add_param_group({"params": [p], "exp_avg_dtype": "fp16"})
    assert len(opt.param_groups) == 1 and p not in opt.state
