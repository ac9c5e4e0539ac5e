"""Router replay at its edges: recomputes, against a plain run of the same layer."""

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

from memory_runs import one_thread  # noqa: F401  (autouse: one OpenMP thread for tiny ops)
from moefold.config import MoEConfig
from moefold.moe.layer import build_moe_layer
from moefold.moe.replay import RouterReplay

D, E, K, B, S = 32, 8, 2, 2, 16


def _layer():
    replay = RouterReplay(1)
    layer = build_moe_layer(D, MoEConfig(num_experts=E, top_k=K, expert_hidden=16), "cpu", torch.float32, replay)
    gen = torch.Generator().manual_seed(0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1, generator=gen)
    return layer, replay


@pytest.mark.parametrize("impl", [CheckpointImpl.NO_REENTRANT, CheckpointImpl.REENTRANT], ids=lambda i: i.name)
def test_torch_checkpoint_recomputes_the_replayed_routing_after_the_block(impl):
    """An RL step replays the engine's experts in the forward and calls backward after the
    `replay()` block; torch's checkpoint recomputed the layer there with a live choice, so the
    gradients were those of other experts than the forward's (0.1 % off, silently)."""
    (plain, plain_replay), (checkpointed, ck_replay) = _layer(), _layer()
    wrapped = checkpoint_wrapper(checkpointed, checkpoint_impl=impl)
    x_BSD = torch.randn(B, S, D, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2)
    engine_TLK = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(B * S)])[:, None]
    assert not torch.equal(plain.router(x_BSD.view(-1, D)).idx_TK, engine_TLK[:, 0])  # live differs

    grads = []
    for module, layer, replay in [(plain, plain, plain_replay), (wrapped, checkpointed, ck_replay)]:
        x = x_BSD.clone().requires_grad_()
        with replay.replay(engine_TLK):
            y = module(x)
        layer.zero_grad(set_to_none=True)
        y.square().mean().backward()  # after the block, as an RL trainer does
        grads.append([x.grad, layer.router.weight.grad, *[p.grad for p in layer.experts.parameters()]])
    for got, expected in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)

    # A live forward afterwards is recomputed live again, as the plain layer computes it.
    grads = []
    for module, layer in [(plain, plain), (wrapped, checkpointed)]:
        x = x_BSD.clone().requires_grad_()
        layer.zero_grad(set_to_none=True)
        module(x).square().mean().backward()
        grads.append([x.grad, layer.router.weight.grad])
    for got, expected in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_recorded_inside_the_record_block_is_refused_not_the_block_before():
    """It returned the previous block's recording, silently: another batch's experts."""
    layer, replay = _layer()
    with replay.record():
        layer(torch.randn(1, 3, D))
    with replay.record():
        layer(torch.randn(B, S, D))
        with pytest.raises(ValueError, match=r"recorded\(\) called inside `with replay.record\(\):`; "
                                             "call it after the block"):
            replay.recorded()
    assert replay.recorded().shape == (B * S, 1, K)
