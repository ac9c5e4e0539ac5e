"""memory.offload on CUDA: pinned host copies on a side stream, prefetched back in backward, train
bit-identically to the plain run (fp32 and bf16 autocast), and take the activations off the GPU."""

import contextlib

import pytest
import torch
from memory_runs import CASES, assert_identical, batches, build, train

from moefold.memory.offload import StreamedHostCopy
from moefold.moe.recomputing import in_backward

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def deterministic():
    """Offload must not change a bit, so the plain run must not change between runs either."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(was)


def cuda_train(config: str, overrides: dict[str, str], autocast: bool):
    model = build(config, overrides, device_type="cuda").cuda()
    amp = (torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext())
    with amp:
        run = train(model, device="cuda")
    torch.cuda.synchronize()
    return model, run


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("config,name", CASES)
def test_offload_on_cuda_is_bit_identical(config, name, autocast):
    _, ref = cuda_train(config, {}, autocast)
    model, run = cuda_train(config, {"memory.offload": f'["{name}"]', "memory.offload_min_bytes": "0"},
                            autocast)
    assert isinstance(model.activation_offload.copier, StreamedHostCopy)
    assert model.activation_offload.offloaded_bytes > 0
    run.rng_after = ref.rng_after  # the CPU generator: untouched either way, compared on CPU tests
    assert_identical(run, ref)


def test_offloaded_layers_free_gpu_memory():
    """After a forward of a larger model, offloading whole layers leaves less allocated."""
    overrides = {"model.dim": "256", "model.n_layers": "4", "moe.expert_hidden": "256"}
    ids = batches(1, device="cuda", seq_len=512)[0]

    def allocated_after_forward(extra):
        model = build("qwen3", {**overrides, **extra}, device_type="cuda").cuda()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = model(ids[:, :-1]).float().logsumexp(-1).mean()
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - before
        loss.backward()  # everything comes back
        torch.cuda.synchronize()
        return kept

    plain = allocated_after_forward({})
    offloaded = allocated_after_forward({"memory.offload": '["layer"]', "memory.offload_min_bytes": "0"})
    assert offloaded < 0.5 * plain, (offloaded, plain)


def test_a_recomputed_layer_copies_to_the_host_in_forward_only():
    """Backward recomputes the layer, and with it the offloaded sites inside: what they save then
    stays on the GPU (test_offload.py on the CPU); every pinned copy is made in forward and brought
    back in backward."""
    model = build("qwen3", {"memory.recompute": '["layer"]', "memory.offload": '["attn_core", "moe_act"]',
                            "memory.offload_min_bytes": "0"}, device_type="cuda").cuda()
    offload, copied_in_backward = model.activation_offload, []
    to_host = offload.copier.to_host

    def recording(storage_B):
        copied_in_backward.append(in_backward())
        return to_host(storage_B)
    offload.copier.to_host = recording
    train(model, device="cuda")
    torch.cuda.synchronize()
    assert copied_in_backward and not any(copied_in_backward)
    assert offload.offloaded_bytes > 0
