"""moefold.dtypes: `cast` returns its input only when it is in the dtype already; a
KeepsBufferDtypes module's buffers keep their dtypes and their values when the model is cast."""

import torch
from conftest import TINY_OVERRIDES

from moefold.config import load_config
from moefold.dtypes import KeepsBufferDtypes, cast
from moefold.models.transformer import build_model


def test_cast_copies_only_across_dtypes():
    x = torch.ones(3)
    assert cast(x, torch.float32) is x
    y = cast(x, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.data_ptr() != x.data_ptr()


class _Counts(KeepsBufferDtypes):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(2))
        # none of them a bf16 value: 257 rounds to 256, 1 + 2^-20 to 1
        self.register_buffer("sum_E", torch.tensor([257.0, 1 + 2 ** -20, 1e-3 + 1e-9]))


def test_buffers_keep_dtype_and_values_through_a_cast_of_the_model():
    """(They went through the cast and back: fp32 again, with bf16's values.)"""
    module = torch.nn.Sequential(_Counts())
    before = module[0].sum_E.clone()
    module.to(torch.bfloat16)
    assert module[0].weight.dtype == torch.bfloat16
    assert module[0].sum_E.dtype == torch.float32 and torch.equal(module[0].sum_E, before)
    module.to(torch.float32).to("meta").to_empty(device="cpu")  # moves still apply
    assert module[0].sum_E.dtype == torch.float32 and module[0].sum_E.device.type == "cpu"


def test_a_trained_expert_bias_survives_casting_the_model_to_bf16():
    cfg = load_config("tiny", {**{k: v for k, v in TINY_OVERRIDES.items() if k.startswith(("model.", "moe."))},
                               "moe.score_func": "sigmoid", "moe.expert_bias": "true"})
    model = build_model(cfg, 64)
    model.init_weights(seed=0)
    routers = [layer.router for layer in model.moe_layers()]
    for router in routers:
        router.expert_bias_E.copy_(torch.linspace(-1e-3, 1e-3, router.expert_bias_E.numel()) + 1e-7)
    before = [r.expert_bias_E.clone() for r in routers]
    model.to(torch.bfloat16)
    assert all(torch.equal(r.expert_bias_E, b) for r, b in zip(routers, before, strict=True))
