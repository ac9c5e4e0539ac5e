"""The router's counter-based jitter on a CUDA GPU: the same noise as on the CPU for the same key and
token places (its int64 hash wraps alike), eager and compiled (run on the H200 through the device tool)."""

import pytest
import torch

from moefold.moe.router import TokenPlaces, UniformJitter, hashed_uniform

pytestmark = pytest.mark.gpu


def test_hashed_uniform_is_the_cpus_on_the_gpu():
    index = torch.cat([torch.arange(4096), torch.tensor([2**32 - 1, 2**32, 2**40 + 12345, 2**62])])
    key = torch.tensor(0xDEADBEEF)
    want = hashed_uniform(index, key)
    assert torch.equal(hashed_uniform(index.cuda(), key.cuda()).cpu(), want)
    assert torch.equal(torch.compile(hashed_uniform)(index.cuda(), key.cuda()).cpu(), want)
    assert 0.0 <= want.min() and want.max() < 1.0


def test_jitter_on_the_gpu_is_the_cpu_hash_of_its_key():
    """The key comes from the device's RNG (so it differs between devices); given the key, the
    noise is the CPU's hash of each element's place."""
    x_TD = torch.randn(300, 64)
    places = TokenPlaces()
    places.data_rank = 3  # the rows of data rank 3: places past the first block
    torch.manual_seed(1)
    got = UniformJitter(0.1)(x_TD.cuda(), True, places).cpu()
    torch.manual_seed(1)
    key = torch.randint(2**32, (), device="cuda").cpu()  # the draw the jitter made
    index_TD = places(300, torch.device("cpu"))[:, None] * 64 + torch.arange(64)
    want = x_TD * (1.0 - 0.1 + 0.2 * hashed_uniform(index_TD, key))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    factor = got / x_TD
    assert factor.std() > 0.03
