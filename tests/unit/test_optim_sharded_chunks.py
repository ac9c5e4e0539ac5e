"""PrecisionAwareAdamW's foreach chunks over sharded parameters on 2 gloo ranks: fp8 blocks whose
last dimension is split complete their maxima in one all-reduce per chunk, so every rank must cut a
param group into the same chunks, also where uneven shards (FSDP's or ZeRO-1's torch.chunk rows)
give the ranks pieces of different sizes. The step then equals one process's bit for bit."""

import datetime

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from moefold.optim import precision
from moefold.optim.precision import PrecisionAwareAdamW

# [257, 32] splits its rows 129 / 128 (4128 and 4096 local elements); the 1-D weights split their
# only (last) dimension, so their fp8 blocks are completed over the ranks.
SHAPES = [(257, 32), (32,), (32,), (32,)]
OPTIONS = {"lr": 1e-2, "weight_decay": 0.0, "exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp8"}


def _step(params: list[torch.nn.Parameter], grads: list[torch.Tensor], steps: int = 2) -> None:
    opt = PrecisionAwareAdamW(params, **OPTIONS)
    for _ in range(steps):
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()


def _sharded_step_equals_one_process(rank: int, limit: int, out) -> None:
    # A mismatch of collectives would hang gloo for its default half hour: fail in seconds.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
    precision.FOREACH_ELEMENTS = limit
    mesh = init_device_mesh("cpu", (2,))
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [torch.randn(s, generator=gen) for s in SHAPES]
    sharded = [torch.nn.Parameter(distribute_tensor(x, mesh, [Shard(0)])) for x in full]
    _step(sharded, [distribute_tensor(g, mesh, [Shard(0)]) for g in grads])
    reference = [torch.nn.Parameter(x.clone()) for x in full]
    _step(reference, grads)
    same = [torch.equal(p.full_tensor(), r.detach()) for p, r in zip(sharded, reference)]
    if rank == 0:
        torch.save(same, out)


# 4120: rank 0's 4128-element piece fills a chunk alone, rank 1's 4096 leave room for one 1-D
# weight, so chunks cut by local sizes differ between the ranks. 10**6: one chunk.
@pytest.mark.parametrize("limit", [4120, 10 ** 6])
def test_uneven_shards_chunk_alike_on_every_rank(limit, tmp_path):
    run_ranks(2, _sharded_step_equals_one_process, limit, tmp_path / "same.pt")
    assert torch.load(tmp_path / "same.pt") == [True] * len(SHAPES)
