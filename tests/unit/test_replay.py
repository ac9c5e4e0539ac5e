"""Router replay: recording, replaying, engine-supplied indices, and clear errors for bad input."""

import pytest
import torch
import torch.nn.functional as F

from moefold.config import MoEConfig
from moefold.moe.replay import RouterReplay
from moefold.moe.router import build_router

D, E, K, L, T = 8, 6, 2, 3, 10


def make_routers(cfg: MoEConfig, replay: RouterReplay, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    routers = [build_router(D, cfg, replay) for _ in range(L)]
    with torch.no_grad():
        for router in routers:
            router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
    return routers


def run(routers, x_TD):
    return [router(x_TD) for router in routers]


X_TD = torch.randn(T, D, generator=torch.Generator().manual_seed(1))


def test_routers_take_layer_indices_in_build_order():
    replay = RouterReplay(L)
    assert [r.replay_layer for r in make_routers(MoEConfig(num_experts=E, top_k=K), replay)] == [0, 1, 2]
    with pytest.raises(ValueError, match="built for 3 layers"):
        build_router(D, MoEConfig(num_experts=E, top_k=K), replay)


def test_routers_of_one_replay_must_agree_on_top_k_and_experts():
    replay = RouterReplay(2)
    build_router(D, MoEConfig(num_experts=E, top_k=K), replay)
    with pytest.raises(ValueError, match="same top_k and num_experts"):
        build_router(D, MoEConfig(num_experts=E, top_k=K + 1), replay)


@pytest.mark.parametrize("variant", [dict(score_func="softmax"),
                                     dict(score_func="softmax", softmax_before_topk=False),
                                     dict(score_func="sigmoid", routed_scaling_factor=2.5)])
def test_record_then_replay_reproduces_the_selection_and_trains_the_router(variant):
    cfg = MoEConfig(num_experts=E, top_k=K, norm_topk_prob=False, **variant)
    replay = RouterReplay(L)
    routers = make_routers(cfg, replay)
    with replay.record():
        recorded = run(routers, X_TD)
    indices_TLK = replay.recorded()
    assert indices_TLK.shape == (T, L, K) and indices_TLK.dtype == torch.int64
    for layer, routing in enumerate(recorded):
        assert torch.equal(indices_TLK[:, layer], routing.idx_TK)

    with torch.no_grad():  # new weights: a live router would now choose differently
        for router in routers:
            router.weight.mul_(-1.0)
    assert not torch.equal(routers[0](X_TD).idx_TK, indices_TLK[:, 0])

    with replay.replay(indices_TLK):
        replayed = run(routers, X_TD)
    for layer, (router, routing) in enumerate(zip(routers, replayed)):
        assert torch.equal(routing.idx_TK, indices_TLK[:, layer])
        logits_TE = F.linear(X_TD, router.weight)
        expected_TK = (logits_TE.gather(-1, routing.idx_TK).softmax(-1) if not cfg.softmax_before_topk
                       else router.score_fn.scores(logits_TE).gather(-1, routing.idx_TK))
        torch.testing.assert_close(routing.probs_TK, expected_TK * cfg.routed_scaling_factor)
        (routing.probs_TK * torch.randn(T, K)).sum().backward()
        assert router.weight.grad.abs().sum() > 0


def test_replay_ends_with_its_context():
    cfg = MoEConfig(num_experts=E, top_k=K)
    replay = RouterReplay(L)
    routers = make_routers(cfg, replay)
    live = [r.idx_TK for r in run(routers, X_TD)]
    forced_TLK = torch.tensor([[0, 1]] * T)[:, None].expand(T, L, K)
    with replay.replay(forced_TLK):
        assert all((r.idx_TK == torch.tensor([0, 1])).all() for r in run(routers, X_TD))
    assert all(torch.equal(r.idx_TK, idx) for r, idx in zip(run(routers, X_TD), live))


def test_engine_supplied_indices_are_used_verbatim():
    cfg = MoEConfig(num_experts=E, top_k=K, softmax_before_topk=False, norm_topk_prob=True)
    replay = RouterReplay(L)
    routers = make_routers(cfg, replay)
    gen = torch.Generator().manual_seed(3)
    # Distinct experts per token and layer, in an arbitrary (not score-sorted) order.
    engine_TLK = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T * L)]).view(T, L, K)
    with replay.replay(engine_TLK.int()):
        routings = run(routers, X_TD)
    for layer, (router, routing) in enumerate(zip(routers, routings)):
        assert torch.equal(routing.idx_TK, engine_TLK[:, layer])
        expected_TK = F.linear(X_TD, router.weight).gather(-1, engine_TLK[:, layer]).softmax(-1)
        torch.testing.assert_close(routing.probs_TK, expected_TK)


def test_recording_concatenates_repeated_calls_in_order():
    replay = RouterReplay(L)
    routers = make_routers(MoEConfig(num_experts=E, top_k=K), replay)
    with replay.record():
        first, second = run(routers, X_TD[:4]), run(routers, X_TD[4:])
    indices_TLK = replay.recorded()
    assert torch.equal(indices_TLK[:4, 1], first[1].idx_TK)
    assert torch.equal(indices_TLK[4:, 1], second[1].idx_TK)


def test_recorded_reports_what_is_missing():
    replay = RouterReplay(L)
    routers = make_routers(MoEConfig(num_experts=E, top_k=K), replay)
    with pytest.raises(ValueError, match="nothing recorded"):
        replay.recorded()
    with replay.record():
        routers[0](X_TD)
    with pytest.raises(ValueError, match=r"layers \[1, 2\] of 3 recorded nothing"):
        replay.recorded()


def test_record_and_replay_do_not_nest():
    replay = RouterReplay(L)
    make_routers(MoEConfig(num_experts=E, top_k=K), replay)
    with replay.record(), pytest.raises(RuntimeError, match="cannot be nested"):
        with replay.replay(torch.zeros(T, L, K, dtype=torch.int64) + torch.arange(K)):
            pass


GOOD_TLK = torch.arange(K).expand(T, L, K)


@pytest.mark.parametrize("indices, message", [
    (None, r"expected indices of shape \[T, L=3, K=2\], got NoneType"),
    (GOOD_TLK.float(), r"expected integer indices of shape \[T, L=3, K=2\], got torch.float32 \[10, 3, 2\]"),
    (GOOD_TLK[:, 0], r"expected indices of shape \[T=10, L=3, K=2\], got \[10, 2\]"),
    (GOOD_TLK[:, :2], r"expected indices of shape \[T=10, L=3, K=2\], got \[10, 2, 2\]"),
    (torch.arange(4).expand(T, L, 4), r"expected indices of shape \[T=10, L=3, K=2\], got \[10, 3, 4\]"),
    (GOOD_TLK + 5, r"expert ids must be in \[0, E=6\), got ids from 5 to 6"),
    (GOOD_TLK - 1, r"expert ids must be in \[0, E=6\), got ids from -1 to 0"),
    (torch.ones(T, L, K, dtype=torch.int64), r"token 0 repeats an expert in layer 0: \[1, 1\]"),
], ids=["missing", "float", "two_dims", "wrong_L", "wrong_K", "too_large", "negative", "duplicate"])
def test_malformed_replay_indices_raise_clear_errors(indices, message):
    replay = RouterReplay(L)
    make_routers(MoEConfig(num_experts=E, top_k=K), replay)
    with pytest.raises(ValueError, match=message):
        with replay.replay(indices):
            pass


def test_replay_indices_for_another_batch_size_raise_at_the_router():
    replay = RouterReplay(L)
    routers = make_routers(MoEConfig(num_experts=E, top_k=K), replay)
    with replay.replay(GOOD_TLK[:7]):
        with pytest.raises(ValueError, match=r"expected indices of shape \[T=10, L=3, K=2\], got \[7, 3, 2\]"):
            routers[0](X_TD)


def test_replay_needs_registered_routers():
    with pytest.raises(ValueError, match="no router registered"):
        with RouterReplay(2).replay(GOOD_TLK):
            pass
