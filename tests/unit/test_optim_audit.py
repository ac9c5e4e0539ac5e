"""Edges of the optimizers found in an audit, each against what torch.optim.AdamW or the docs
(docs/optimizer.md) promise. The meta device stands in for CUDA where a state's device matters:
a CPU-only machine has no other device than the CPU."""

import torch

from moefold.optim import precision
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
