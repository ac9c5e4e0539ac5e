"""The parallel transforms on NCCL with world size 1 (every group of size 1): the same numbers as
the plain model, on the GPU. Multi-GPU runs are the withheld-GPU issue."""

import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist

from moe_reference import build, random_config
from moefold.config import MoEConfig, load_config
from moefold.models.transformer import build_model
from moefold.parallel.dims import ParallelDims, ParallelLayout
from moefold.parallel.expert import apply_ep
from moefold.parallel.tensor import apply_tp

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def layout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    saved = dict(os.environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield ParallelLayout(ParallelDims(1), device_type="cuda")
    dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)  # later tests' trainers must not think torchrun launched them


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("seed", range(4))
def test_expert_parallel_dispatchers_on_nccl(layout, dispatcher, seed):
    cfg = random_config(seed)
    cfg.pad_to_capacity &= dispatcher == "alltoall"  # all-gather's buffer is static already
    cfg.expert_hidden, cfg.experts_backend = 16, "grouped_mm"
    plain = build(cfg, 32, seed).float().cuda()
    ep = copy.deepcopy(plain)
    apply_ep(ep, layout.ep_group, dispatcher=dispatcher)
    x = torch.randn(64, 32, device="cuda")
    x_ep = x.clone().requires_grad_()
    x.requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y, y_ep = plain(x), ep(x_ep)
    y.float().square().sum().backward()
    y_ep.float().square().sum().backward()
    torch.testing.assert_close(y_ep, y)
    torch.testing.assert_close(x_ep.grad, x.grad)
    for (name, p), p_ep in zip(plain.named_parameters(), ep.parameters()):
        torch.testing.assert_close(p_ep.grad, p.grad, msg=name)


@pytest.mark.parametrize("pad_multiple", [0, 16])
def test_expert_parallel_padded_to_capacity_runs_in_a_cuda_graph(layout, pad_multiple):
    """Every expert padded to its capacity under EP (CapacityAllToAllDispatcher): no host sync
    anywhere in the layer, so its forward captures into a CUDA graph (a sync would fail the
    capture), and replays on new tokens give the plain layer's output."""
    cfg = MoEConfig(num_experts=8, top_k=2, expert_hidden=16, experts_backend="grouped_mm",
                    aux_loss_coeff=0.0, capacity_factor=1.0, pad_to_capacity=True, pad_multiple=pad_multiple)
    plain = build(cfg, 32, 0).to("cuda", torch.bfloat16).eval()  # fp32 grouped GEMMs sync on CUDA
    ep = copy.deepcopy(plain)
    apply_ep(ep, layout.ep_group)
    x_static = torch.randn(1, 64, 32, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream, as CUDA graphs need
            ep(x_static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_static = ep(x_static)
        for seed in range(3):
            x = torch.randn(1, 64, 32, device="cuda", dtype=torch.bfloat16,
                            generator=torch.Generator("cuda").manual_seed(seed))
            x_static.copy_(x)
            graph.replay()
            torch.testing.assert_close(y_static, plain(x))


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-deepseek"])
def test_tensor_parallel_on_nccl(layout, preset):
    model = build_model(load_config(preset), vocab_size=300, device_type="cuda", compute_dtype=torch.bfloat16)
    model.init_weights(seed=0)
    model.cuda()
    tp = copy.deepcopy(model)
    apply_tp(tp, layout.tp_mesh)
    ids = torch.randint(0, 300, (2, 64), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits, logits_tp = model(ids), tp(ids)
    torch.testing.assert_close(logits_tp, logits)
    logits.float().logsumexp(-1).sum().backward()
    logits_tp.float().logsumexp(-1).sum().backward()
    for (name, p), p_tp in zip(model.named_parameters(), tp.parameters()):
        grad = p_tp.grad.full_tensor() if hasattr(p_tp.grad, "full_tensor") else p_tp.grad
        torch.testing.assert_close(grad, p.grad, msg=name)


def test_fp8_moments_of_a_last_dimension_split_take_the_kernel(layout, monkeypatch):
    """A parameter split along its last dimension at block boundaries (here over a one-rank mesh:
    the piece is the whole row) holds its fp8 blocks whole: the optimizer's Triton kernel steps it
    as it steps the plain tensor, bit for bit, instead of leaving it to the foreach path."""
    import moefold.optim.precision as precision
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = layout.tp_mesh
    options = {"lr": 1e-2, "weight_decay": 0.1, "exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8",
               "master": "bf16+remainder", "fused": True}
    gen = torch.Generator(device="cuda").manual_seed(0)
    full = torch.randn(3, 512, device="cuda", generator=gen).bfloat16()
    plain = torch.nn.Parameter(full.clone())
    split = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(1)]))
    kernel_calls = []
    kernel = precision.fused_adamw_step_
    monkeypatch.setattr(precision, "fused_adamw_step_",
                        lambda param, *a, **k: kernel_calls.append(param.shape) or kernel(param, *a, **k))
    opts = [precision.PrecisionAwareAdamW([p], **options) for p in (plain, split)]
    for _ in range(3):
        grad = torch.randn(3, 512, device="cuda", generator=gen).bfloat16()
        plain.grad = grad.clone()
        split.grad = distribute_tensor(grad.clone(), mesh, [Shard(1)])
        for opt in opts:
            opt.step()
    assert len(kernel_calls) == 6
    assert torch.equal(split.full_tensor(), plain.detach())
    for key, value in opts[0].state[plain].items():
        got = opts[1].state[split][key]
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                           value.view(torch.uint8) if value.dtype == torch.float8_e4m3fn else value), key
