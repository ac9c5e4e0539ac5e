"""The global gradient norm (GradNormClipper) against a naive reference: the fp64 norm of all
gradients, and torch.nn.utils.clip_grad_norm_'s coefficient, for fp32 and bf16 gradients (bf16
masters' and parameters'). The sharded layouts against one process: tests/distributed."""

import pytest
import torch

from moefold.parallel.data import GradNormClipper

SHAPES = [(4096, 64), (512,), (64, 64, 4)]


def _params(dtype):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in SHAPES]
    for p in params:  # rows of very different sizes, as real gradients have
        p.grad = (torch.randn(p.shape, generator=gen) * torch.rand(p.shape[0], *[1] * (p.dim() - 1),
                                                                   generator=gen).mul(8).exp2()).to(dtype)
    return params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_is_the_fp64_norm_of_the_gradients(dtype):
    """Each tensor's norm is taken in fp32: bf16 gradients' norms were rounded to bf16 each (880.0
    for a tensor of norm 881.22; here 0.22% off), and a layout's pieces rounded otherwise than the
    whole tensors. (fp32's own sums of 262,144 squares: 1.5e-5.)"""
    params = _params(dtype)
    want = torch.cat([p.grad.double().reshape(-1) for p in params]).norm()
    norm = GradNormClipper(params)(float("inf"))
    assert norm.dtype == torch.float32
    torch.testing.assert_close(norm.double(), want, rtol=1e-4, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clipping_scales_every_gradient_to_the_max_norm(dtype):
    params = _params(dtype)
    before = [p.grad.double() for p in params]
    total = torch.cat([g.reshape(-1) for g in before]).norm()
    max_norm = total.item() / 10
    GradNormClipper(params)(max_norm)
    for p, g in zip(params, before):  # the clip coefficient max_norm / (norm + 1e-6), as torch's
        want = (g * (max_norm / (total + 1e-6))).to(dtype)
        # bf16: the product by the coefficient rounded to bf16 (one ulp, docs/optimizer.md)
        torch.testing.assert_close(p.grad, want, rtol=1e-4 if dtype == torch.float32 else 2 ** -7, atol=0)


# ---------------------------------------------------------------- several ranks (gloo, two meshes)

# (shape, dtype, mesh, placements): rows split unevenly, a replicated norm weight, a plain tensor
# (every rank holds it alike), an expert weight on its own 2-D mesh, a bf16 column split.
SHARDED = [((33, 8), torch.float32, "dense", ("S0",)), ((8,), torch.float32, "dense", ("R",)),
           ((5,), torch.float32, None, ()), ((4, 6, 8), torch.float32, "expert", ("S0", "S1")),
           ((6, 10), torch.bfloat16, "dense", ("S1",))]


def _sharded_grads_clip_like_one_process(rank: int, max_norm: float, out) -> None:
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    meshes = {"dense": init_device_mesh("cpu", (2,)), "expert": init_device_mesh("cpu", (2, 1))}
    gen = torch.Generator().manual_seed(0)
    fulls = [(torch.randn(shape, generator=gen) * 4).to(dtype) for shape, dtype, _, _ in SHARDED]
    params = []
    for full, (_, _, mesh, names) in zip(fulls, SHARDED):
        if mesh is None:
            p = torch.nn.Parameter(torch.zeros_like(full))
            p.grad = full.clone()
        else:
            placements = [Replicate() if n == "R" else Shard(int(n[1])) for n in names]
            p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(full), meshes[mesh], placements))
            p.grad = distribute_tensor(full.clone(), meshes[mesh], placements)  # scaled in place
        params.append(p)
    norm = GradNormClipper(params, dist.group.WORLD)(max_norm)
    clipped = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in params]
    if rank == 0:
        torch.save({"norm": norm, "fulls": fulls, "clipped": clipped}, out)


@pytest.mark.parametrize("max_norm", [5.0, float("inf")])
def test_sharded_norm_and_clipping_equal_the_fp64_whole_tensors(max_norm, tmp_path):
    """The global norm over two meshes counts every element once: shards summed, replicated and
    plain tensors not twice; every piece is scaled by min(1, max_norm / (norm + 1e-6))."""
    from ranks import run_ranks

    run_ranks(2, _sharded_grads_clip_like_one_process, max_norm, tmp_path / "out.pt")
    got = torch.load(tmp_path / "out.pt")
    want = torch.cat([g.double().reshape(-1) for g in got["fulls"]]).norm()
    torch.testing.assert_close(got["norm"].double(), want, rtol=1e-6, atol=0)
    coef = min(1.0, max_norm / (want.item() + 1e-6))
    assert coef < 1 or max_norm == float("inf")
    for full, clipped in zip(got["fulls"], got["clipped"], strict=True):
        rtol = 1e-6 if full.dtype == torch.float32 else 2 ** -8
        torch.testing.assert_close(clipped.double(), full.double() * coef, rtol=rtol, atol=0)


def _one_rank_without_gradients(rank: int, out) -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    p = torch.nn.Parameter(torch.zeros(4))
    if rank == 0:  # rank 1's parameter took no part in the loss: its .grad stays None
        p.grad = torch.tensor([3.0, 0.0, 0.0, 4.0])
    norm = GradNormClipper([p], dist.group.WORLD)(1.0)  # plain tensors: replicated, counted once
    torch.save({"norm": norm, "grad": p.grad}, f"{out}.{rank}")


def test_a_rank_without_gradients_still_joins_the_global_norm(tmp_path):
    """A rank with no gradients returned before the all-reduce the others entered: they hung until
    the process group's timeout. It now adds zero, and every rank returns the same global norm."""
    from ranks import run_ranks

    run_ranks(2, _one_rank_without_gradients, tmp_path / "out")
    got = [torch.load(f"{tmp_path / 'out'}.{rank}") for rank in range(2)]
    # the plain tensor counts once over 2 replicas: rank 0 adds 25/2, rank 1 nothing
    assert [g["norm"].item() for g in got] == [pytest.approx(12.5 ** 0.5)] * 2
    torch.testing.assert_close(got[0]["grad"], torch.tensor([3.0, 0.0, 0.0, 4.0]) / (12.5 ** 0.5 + 1e-6))
    assert got[1]["grad"] is None
