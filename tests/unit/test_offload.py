"""memory.offload on CPU: the hooks copy each chosen saved tensor to a host tensor and back, training
stays bit-identical with every option, parameters and small tensors stay put, fewer bytes stay on
the device side."""

import pytest
import torch
from memory_runs import (
    CONFIGS,
    MODULES,
    SavedBytes,
    assert_identical,
    batches,
    build,
    one_thread,  # noqa: F401 (autouse fixture)
    plain_run,
    train,
)

from moefold.memory.offload import ActivationOffload, HostCopy

CASES = [(config, name) for config in CONFIGS for name in MODULES[config]]


class SpyingCopy(HostCopy):
    """Records what went to the host."""

    def __init__(self):
        super().__init__()
        self.moved: list[torch.Tensor] = []

    def to_host(self, t):
        self.moved.append(t)
        return super().to_host(t)


def offloaded(config: str, names: str, min_bytes: int = 0, **extra):
    model = build(config, {"memory.offload": names, "memory.offload_min_bytes": str(min_bytes), **extra})
    spy = model.activation_offload.copier = SpyingCopy()
    return model, spy


@pytest.mark.parametrize("config,name", CASES)
def test_offload_trains_bit_identically(config, name):
    model, spy = offloaded(config, f'["{name}"]')
    run = train(model)
    assert spy.moved, f"{name}: nothing was offloaded"
    assert model.activation_offload.offloaded_bytes == sum(t.numel() * t.element_size() for t in spy.moved)
    assert_identical(run, plain_run(config))


@pytest.mark.parametrize("config,name", CASES)
def test_offload_leaves_fewer_bytes_on_the_device(config, name, monkeypatch):
    ids = batches(1)[0]
    plain_model, (model, _) = build(config), offloaded(config, f'["{name}"]')
    plain = SavedBytes(plain_model, monkeypatch).of_forward(plain_model, ids)
    left = SavedBytes(model, monkeypatch).of_forward(model, ids)
    print(f"{config} {name}: {left} of {plain} bytes stay, "
          f"{model.activation_offload.offloaded_bytes} offloaded")
    assert left < plain


def test_parameters_their_casts_and_small_tensors_stay():
    model, spy = offloaded("deepseek", '["layer"]', min_bytes=2048)
    train(model, steps=1, accum=1)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert spy.moved
    assert all(type(t) is torch.Tensor and not t.requires_grad or not t.is_leaf for t in spy.moved)
    assert all(t.untyped_storage().data_ptr() not in params for t in spy.moved)
    assert min(t.numel() * t.element_size() for t in spy.moved) >= 2048
    everything, spy_all = offloaded("deepseek", '["layer"]', min_bytes=0)
    train(everything, steps=1, accum=1)
    assert len(spy_all.moved) > len(spy.moved)


def test_a_weight_cast_is_not_offloaded():
    w = torch.nn.Parameter(torch.randn(64, 64))
    offload = ActivationOffload(0, SpyingCopy())
    x = torch.randn(8, 64, requires_grad=True) * 1.0  # an activation, not a leaf
    with torch.autograd.graph.saved_tensors_hooks(offload.pack, offload.unpack):
        y = (x.double() @ w.double()).sum()  # saves x.double() (an activation) and w.double()
    y.backward()
    assert [t.shape for t in offload.copier.moved] == [(8, 64)]


def test_host_copy_keeps_strides_and_values_of_views():
    base = torch.randn(4, 6, 10)
    offload = ActivationOffload(0, HostCopy())
    for view in (base.split([7, 3], dim=-1)[0], base.transpose(0, 2), base[:, 1]):
        back = offload.unpack(offload.pack(view))
        assert back.stride() == view.stride() and torch.equal(back, view)
        assert back.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()
    broadcast = base[:1].expand(3, 6, 10)  # stride 0: stays
    assert offload.pack(broadcast) is broadcast


def test_offload_with_recompute_is_bit_identical():
    run = train(build("deepseek", {"memory.recompute": '["norm", "moe_act", "mla_up_proj"]',
                                   "memory.offload": '["attn_core", "mlp", "shared_experts"]',
                                   "memory.offload_min_bytes": "0"}))
    assert_identical(run, plain_run("deepseek"))


def test_offloading_a_region_with_recompute_inside_is_bit_identical():
    run = train(build("qwen3", {"memory.recompute": '["attn_core", "moe_act"]',
                                "memory.offload": '["layer"]', "memory.offload_min_bytes": "0"}))
    assert_identical(run, plain_run("qwen3"))
