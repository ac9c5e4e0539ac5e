"""An MoE layer under torch's own activation checkpointing (`checkpoint_wrapper`, built on
torch.utils.checkpoint), which runs the layer's forward again in backward without telling it.
moefold's memory.recompute replays the forward's decisions (tests/unit/test_recompute.py); under
torch's, the recompute finds out it runs in backward (moe/recomputing.py): it records nothing a
second time and takes the global-batch balancing counts as its forward left them."""

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

from moefold.config import MoEConfig
from moefold.moe.layer import build_moe_layer
from moefold.moe.replay import RouterReplay

IMPLS = [CheckpointImpl.NO_REENTRANT, CheckpointImpl.REENTRANT]


def _layer(replay=None):
    cfg = MoEConfig(num_experts=8, top_k=2, expert_hidden=16, expert_bias=True, z_loss_coeff=1e-3,
                    global_aux_loss_coeff=0.1)
    layer = build_moe_layer(32, cfg, "cpu", torch.float32, replay)
    gen = torch.Generator().manual_seed(0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1, generator=gen)
    return layer


def _step(module, x_BSD, valid_BS=None):
    x_BSD = x_BSD.clone().requires_grad_()
    module(x_BSD, valid_BS).square().mean().backward()
    return x_BSD.grad


@pytest.mark.parametrize("impl", IMPLS, ids=lambda impl: impl.name)
def test_statistics_and_step_counts_are_recorded_once(impl):
    """The recompute counted every routed token, the entropy and each aux value a second time, the
    expert-bias update read twice the step's load, and the global-batch loss's counts held each
    micro-batch twice (the second micro-batch's logged loss was off)."""
    plain, checkpointed = _layer(), _layer()
    wrapped = checkpoint_wrapper(checkpointed, checkpoint_impl=impl)
    valid_BS = torch.rand(2, 16, generator=torch.Generator().manual_seed(1)) < 0.8
    for seed in range(2):  # two micro-batches of one optimizer step
        x_BSD = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(seed))
        grads = [_step(plain, x_BSD, valid_BS), _step(wrapped, x_BSD, valid_BS)]
        torch.testing.assert_close(grads[1], grads[0])
    torch.testing.assert_close(checkpointed.router.weight.grad, plain.router.weight.grad)
    for name in ("step_tokens_per_expert_E", "balancer.global_counts_E", "balancer.global_tokens"):
        assert torch.equal(checkpointed.get_buffer(name), plain.get_buffer(name)), name
    stats = [plain.stats.pop(), checkpointed.stats.pop()]
    assert stats[1].keys() == stats[0].keys()
    for key in stats[0]:
        torch.testing.assert_close(stats[1][key], stats[0][key], msg=key)
    assert stats[1]["aux_calls/z_loss"] == 2


def test_router_replay_records_each_forward_once():
    replay = RouterReplay(1)
    wrapped = checkpoint_wrapper(_layer(replay))
    with replay.record():
        _step(wrapped, torch.randn(2, 16, 32))
    assert replay.recorded().shape == (32, 1, 2)  # not the recompute's 32 more

