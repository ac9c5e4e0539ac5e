"""memory.offload on CPU: the hooks copy the storage of each chosen saved tensor to a host tensor
once per region and bring it back as the same views, training stays bit-identical with every option,
parameters and small tensors stay put, fewer bytes stay on the device side, and nothing is left on
the host after backward."""

import contextlib
import weakref

import pytest
import torch
from memory_runs import CASES, SavedBytes, assert_identical, batches, build, plain_run, train
from memory_runs import one_thread  # noqa: F401 (autouse fixture)

from moefold.memory.offload import ActivationOffload, HostCopy
from moefold.moe.recomputing import in_backward
from moefold.parallel.sequence import SumGrad
from moefold.train.loss import build_objective


class Spy:
    """What an offload sent to the host: per region, each saved tensor that went with its version
    when saved (kept alive, so storages stay distinct), and weak references to the host copies."""

    def __init__(self, offload: ActivationOffload):
        self.regions: list[list[tuple[torch.Tensor, int]]] = []
        self.host_copies: list[weakref.ref[torch.Tensor]] = []
        region, pack, to_host = offload.region, offload.pack, offload.copier.to_host

        @contextlib.contextmanager
        def recording_region():
            self.regions.append([])
            with region():
                yield

        def recording_pack(t):
            packed = pack(t)
            if not isinstance(packed, torch.Tensor):  # gone to the host
                self.regions[-1].append((t, t._version))
            return packed

        def recording_to_host(storage_B):
            packed = to_host(storage_B)
            self.host_copies.append(weakref.ref(packed.host_B))
            return packed
        offload.region, offload.pack = recording_region, recording_pack
        offload.copier.to_host = recording_to_host

    @property
    def moved(self) -> list[torch.Tensor]:
        return [t for region in self.regions for t, _ in region]

    def held_host_bytes(self) -> int:
        """The bytes of the host copies something still holds (a saved tensor's graph node)."""
        return sum(h.nbytes for h in (ref() for ref in self.host_copies) if h is not None)

    def distinct_storage_bytes(self) -> int:
        """The bytes of each region's distinct storages (as of their version when saved)."""
        return sum(sum({(t.untyped_storage().data_ptr(), version): t.untyped_storage().nbytes()
                        for t, version in region}.values()) for region in self.regions)


def offloaded(config: str, names: str, min_bytes: int = 0, **extra):
    model = build(config, {"memory.offload": names, "memory.offload_min_bytes": str(min_bytes), **extra})
    return model, Spy(model.activation_offload)


@pytest.mark.parametrize("config,name", CASES)
def test_offload_trains_bit_identically(config, name):
    model, spy = offloaded(config, f'["{name}"]')
    run = train(model)
    assert spy.moved, f"{name}: nothing was offloaded"
    # backward brings every copy back: nothing offloaded belongs to a graph that dies in forward
    assert 0 < model.activation_offload.offloaded_bytes == spy.distinct_storage_bytes()
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
    offload = ActivationOffload(0, HostCopy())
    spy = Spy(offload)
    x = torch.randn(8, 64, requires_grad=True) * 1.0  # an activation, not a leaf
    with offload.region():
        y = (x.double() @ w.double()).sum()  # saves x.double() (an activation) and w.double()
    y.backward()
    assert [t.shape for t in spy.moved] == [(8, 64)]


def test_a_weight_whose_gradient_tp_sums_is_not_offloaded():
    """A replicated weight read through TP's gradient sum (a sequence-parallel router, QK-norms)
    and cast is still the weight: on the device for the whole step anyway."""
    w = torch.nn.Parameter(torch.randn(64, 64))
    offload = ActivationOffload(0, HostCopy())
    spy = Spy(offload)
    x = torch.randn(8, 64, requires_grad=True) * 1.0
    with offload.region():
        (x.double() @ SumGrad.apply(w, None).double()).sum()  # the group is read in backward only
    assert [t.shape for t in spy.moved] == [(8, 64)]


def test_tensors_on_one_storage_go_to_the_host_once_and_come_back_as_its_views():
    base = torch.randn(4, 6, 10)
    offload = ActivationOffload(0, HostCopy())
    views = (base, base, base.split([7, 3], dim=-1)[0], base.transpose(0, 2), base[:, 1],
             base.view(torch.int32)[1:])
    with offload.region():
        packed = [offload.pack(v) for v in views]
    back = [offload.unpack(p) for p in packed]
    assert offload.offloaded_bytes == base.untyped_storage().nbytes()  # 960 B (one by one: 4,432)
    for b, v in zip(back, views):
        assert (b.dtype, b.shape, b.stride(), b.storage_offset()) == \
            (v.dtype, v.shape, v.stride(), v.storage_offset())
        assert torch.equal(b, v)
    assert len({b.untyped_storage().data_ptr() for b in back}) == 1
    assert back[0].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    broadcast = base[:1].expand(3, 6, 10)  # stride 0: stays
    assert offload.pack(broadcast) is broadcast


def test_offload_min_bytes_applies_to_the_storage_that_moves():
    """Small views of one large storage go (it moves whole, once); a small storage stays."""
    base = torch.randn(4, 6, 10)  # 960 B
    offload = ActivationOffload(512, HostCopy())
    views = (base[0], base[1:3, :, 0], base.view(torch.int32)[3])  # 240, 32 and 240 B
    with offload.region():
        packed = [offload.pack(v) for v in views]
    assert not any(isinstance(p, torch.Tensor) for p in packed)
    assert [offload.unpack(p).tolist() for p in packed] == [v.tolist() for v in views]
    small_N = torch.randn(100)  # 400 B
    half_N = small_N[:50]
    with offload.region():
        assert offload.pack(half_N) is half_N and offload.pack(small_N) is small_N


def test_offloaded_bytes_count_the_copies_backward_brings_back():
    """A copy whose graph node dies in forward (its output unused) is never brought back: it does
    not count, while backward's first restore of a copy does, once."""
    a = torch.randn(64, requires_grad=True)
    offload = ActivationOffload(0, HostCopy())
    with offload.region():
        kept = (a * 1.0).sin()  # saves a · 1, 256 B
        (a * 2.0).cos()  # saves a · 2 for a node nothing keeps
    assert offload.offloaded_bytes == 0
    kept.sum().backward()
    assert offload.offloaded_bytes == 64 * 4


@pytest.mark.parametrize("config,name", CASES)
def test_offloaded_bytes_are_the_host_copies_forward_leaves(config, name):
    model, spy = offloaded(config, f'["{name}"]')
    ids = batches(1)[0]
    loss, _ = build_objective(model)(model, ids[:, :-1], ids[:, 1:])
    held = spy.held_host_bytes()
    loss.backward()
    assert model.activation_offload.offloaded_bytes == held > 0


class DeviceLikeCopy(HostCopy):
    """Brings each storage back as a new tensor, as the CUDA copier does, and counts the restores."""

    def __init__(self):
        super().__init__()
        self.restored: list[weakref.ref[torch.Tensor]] = []

    def to_device(self, packed):
        restored_B = packed.host_B.clone()
        self.restored.append(weakref.ref(restored_B))
        return restored_B


def swiglu_with_shared_storages(x_TD, w_DF2, w_FD):
    """Saves 6 tensors on 4 storages: x (by two GEMMs), the gate and up halves of one fused output
    (by silu and mul), silu's output and the down GEMM's input."""
    g_TF, u_TF = (x_TD @ w_DF2).chunk(2, dim=-1)
    return ((torch.nn.functional.silu(g_TF) * u_TF) @ w_FD + x_TD @ w_DF2[:, :1]).sum()


def test_a_region_restores_each_storage_once_and_drops_it_when_every_view_was_unpacked():
    gen = torch.Generator().manual_seed(0)
    a_TD, w_DF2, w_FD = (torch.randn(*shape, generator=gen, requires_grad=True)
                         for shape in ((16, 8), (8, 64), (32, 8)))
    plain = torch.autograd.grad(swiglu_with_shared_storages(a_TD * 1.0, w_DF2, w_FD), (a_TD, w_DF2, w_FD))
    offload = ActivationOffload(0, DeviceLikeCopy())
    spy = Spy(offload)
    with offload.region():
        loss = swiglu_with_shared_storages(a_TD * 1.0, w_DF2, w_FD)
    assert len(spy.moved) == 6 and len(spy.host_copies) == 4
    grads = torch.autograd.grad(loss, (a_TD, w_DF2, w_FD), retain_graph=True)
    assert offload.offloaded_bytes == spy.distinct_storage_bytes() == 4 * 16 * (8 + 64 + 32 + 32)
    assert all(torch.equal(g, p) for g, p in zip(grads, plain))
    assert len(offload.copier.restored) == 4 and not any(r() for r in offload.copier.restored)
    assert all(h() is not None for h in spy.host_copies)  # the retained graph still needs them
    again = torch.autograd.grad(loss, (a_TD, w_DF2, w_FD))
    assert all(torch.equal(g, p) for g, p in zip(again, plain))
    assert len(offload.copier.restored) == 8 and not any(r() for r in offload.copier.restored)
    assert offload.offloaded_bytes == 4 * 16 * (8 + 64 + 32 + 32)  # each copy counted once
    assert not any(h() for h in spy.host_copies)  # backward released the graph: loss still lives


def test_a_storage_written_in_place_after_saving_is_copied_again():
    """Each saved tensor comes back with the values it had when saved (autograd checks no version
    of a hooked tensor), so a storage whose version moved is not shared with the earlier copy."""
    a = torch.randn(64, requires_grad=True)
    offload = ActivationOffload(0, HostCopy())
    with offload.region():
        x = a * 1.0
        y = x.sin()  # saves x
        x.mul_(2.0)
        loss = y.sum() + x.cos().sum()  # saves x again, written since
    loss.backward()
    b = a.detach().requires_grad_()
    x = b * 1.0
    (x.sin().sum() + (x * 2.0).cos().sum()).backward()
    assert torch.equal(a.grad, b.grad)
    assert offload.offloaded_bytes == 2 * 64 * 4


def test_no_host_copy_outlives_backward():
    model, spy = offloaded("deepseek", '["layer"]')
    ids = batches(1)[0]
    loss, _ = build_objective(model)(model, ids[:, :-1], ids[:, 1:])
    assert spy.host_copies and all(h() is not None for h in spy.host_copies)  # none of a dead graph
    loss.backward()
    assert not any(h() for h in spy.host_copies)  # loss, and with it the graph, still lives
    assert model.activation_offload._regions == []


def test_offload_with_recompute_is_bit_identical():
    run = train(build("deepseek", {"memory.recompute": '["norm", "moe_act", "mla_up_proj"]',
                                   "memory.offload": '["attn_core", "mlp", "shared_experts"]',
                                   "memory.offload_min_bytes": "0"}))
    assert_identical(run, plain_run("deepseek"))


def test_offloading_a_region_with_recompute_inside_is_bit_identical():
    run = train(build("qwen3", {"memory.recompute": '["attn_core", "moe_act"]',
                                "memory.offload": '["layer"]', "memory.offload_min_bytes": "0"}))
    assert_identical(run, plain_run("qwen3"))


def test_a_site_offloaded_inside_a_recomputed_one_offloads_in_forward():
    """Its hooks are the innermost ones, inside the checkpoint's: what it saves goes to the host
    in forward, results bit-identical."""
    names, recompute = '["attn_core", "moe_act", "norm"]', {"memory.recompute": '["layer"]'}
    model, spy = offloaded("qwen3", names, **recompute)
    ids = batches(1)[0]
    build_objective(model)(model, ids[:, :-1], ids[:, 1:])
    assert spy.moved
    assert_identical(train(offloaded("qwen3", names, **recompute)[0]), plain_run("qwen3"))


@pytest.mark.parametrize("recompute,names", [("layer", '["attn_core", "moe_act", "norm"]'),
                                             ("moe", '["moe_act"]')])
def test_a_recompute_in_backward_copies_nothing_and_leaves_nothing(recompute, names):
    """Backward recomputes the region, running the offloaded sites in it again, for a graph that is
    never differentiated (the forward graph holds their host copies): what they save then stays on
    the device and goes with the recompute. It was copied to the host again, as much as forward
    copied (here `layer`: 40 copies, 167,424 B; `moe`: 6, 33,280 B); the tensor itself, kept as
    is, closes a cycle (an op's saved output, its grad_fn) that kept the recomputed graph alive
    after backward."""
    model, spy = offloaded("qwen3", names, **{"memory.recompute": f'["{recompute}"]'})
    offload, in_recompute = model.activation_offload, []
    pack = offload.pack

    def recording(t):
        packed = pack(t)
        if in_backward() and type(packed) is torch.Tensor:  # (a parameter lives on)
            in_recompute.append(weakref.ref(packed))
        return packed
    offload.pack = recording
    ids = batches(1)[0]
    loss, _ = build_objective(model)(model, ids[:, :-1], ids[:, 1:])
    copies = len(spy.host_copies)
    loss.backward()
    assert len(spy.host_copies) == copies, f"{len(spy.host_copies) - copies} copies in backward"
    assert in_recompute  # and, loss and its graph still alive, none of it lives on:
    assert not any(ref() is not None for ref in in_recompute)


@pytest.mark.parametrize("device_type,copier", [("cpu", "HostCopy"), ("cuda", "StreamedHostCopy"),
                                                 ("cuda:1", "StreamedHostCopy")])
def test_a_device_with_an_index_gets_its_types_copier(device_type, copier):
    """apply_offload from Python with "cuda:1" took the synchronous host copy of the CPU."""
    from moefold.memory.offload import apply_offload

    offload = apply_offload(build("qwen3"), ["moe"], 0, device_type)
    assert type(offload.copier).__name__ == copier


def test_offload_from_python_is_checked_against_the_models_recompute_as_the_config_does():
    """apply_offload from Python took a name the model recomputes (which keeps nothing to offload)
    and a negative min_bytes; the config refuses both, and so does the call now, in its words."""
    from moefold.config import ConfigError
    from moefold.memory.offload import apply_offload

    model = build("qwen3", {"memory.recompute": '["moe"]'})
    with pytest.raises(ConfigError, match="moe is also recomputed"):
        apply_offload(model, ["moe"], 0, "cpu")
    with pytest.raises(ConfigError, match="offload_min_bytes=-1 must be >= 0"):
        apply_offload(model, ["attn_core"], -1, "cpu")
    assert apply_offload(model, ["attn_core"], 0, "cpu") is not None
