"""Config coherence and the MoE layer's input errors (audit 7).

A [T, D] input with the sequence aux loss on is refused as moefold's own error; the balancer's own
counts (no counts given) drop nothing, padding or not; and the options found inert only in
degenerate contexts that workflows reach on purpose (round-robin routing of a real preset, a
one-step smoke test) are accepted, for the reasons their docs give."""

import pytest
import torch

from moefold.config import MoEConfig, load_config, read_run_config, to_toml
from moefold.errors import UserError
from moefold.moe.balance import LoadBalancer, LocalCounts
from moefold.moe.layer import build_moe_layer
from moefold.moe.router import Router
from moefold.optim.schedule import cosine, wsd


# ----------------------------------------------------------------------------- the layer's input


def _layer(**options) -> torch.nn.Module:
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=8, experts_backend="loop", **options)
    return build_moe_layer(8, moe, "cpu", torch.float32).train()


def test_a_token_matrix_with_the_sequence_aux_loss_is_a_user_error_naming_the_option():
    """It was a bare ValueError: the CLI's one-line report (UserError, exit 2) missed it."""
    layer = _layer(aux_loss_coeff=0.0, seq_aux_loss_coeff=0.01)
    with pytest.raises(UserError) as err:
        layer(torch.randn(6, 8))
    message = str(err.value)
    assert "moe.seq_aux_loss_coeff=0.01" in message and "[B, S, D]" in message and "[6, 8]" in message
    assert "\n" not in message


# ----------------------------------------------------------------------------- the balancer's counts


def _naive_dropped(idx_TK: torch.Tensor, keep_N: torch.Tensor, valid_T: torch.Tensor | None) -> int:
    """Valid (token, k) copies the capacity did not keep, one by one."""
    T, K = idx_TK.shape
    return sum(1 for t in range(T) for k in range(K)
               if (valid_T is None or bool(valid_T[t])) and not bool(keep_N[t * K + k]))


@pytest.mark.parametrize("seed", range(8))
def test_local_counts_drop_only_valid_copies_not_kept(seed):
    """`dropped` counts the real copies the capacity left out, whatever keep_N says of padding."""
    gen = torch.Generator().manual_seed(seed)
    T, K, E = 12, 2, 4
    idx_TK = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    keep_N = torch.rand(T * K, generator=gen) < 0.7
    valid_T = torch.rand(T, generator=gen) < 0.6
    for valid in (None, valid_T):
        counts = LocalCounts()(idx_TK, keep_N, E, valid)
        assert int(counts.dropped) == _naive_dropped(idx_TK, keep_N, valid)


def test_the_balancer_counting_alone_drops_nothing_with_padding():
    """LoadBalancer.forward(counts=None) counts its micro-batch with nothing dropped: with padding
    it made `dropped` minus the padded copies (-4 for 2 padded tokens of top-2)."""
    cfg = MoEConfig(num_experts=4, top_k=2, aux_loss_coeff=0.01)
    router, balancer = Router(8, cfg), LoadBalancer(cfg)
    torch.nn.init.normal_(router.weight)
    seen = []
    name, coeff, loss_fn = balancer.terms[0]
    balancer.terms = [(name, coeff, lambda *args: seen.append(args[3]) or loss_fn(*args))]
    valid_T = torch.tensor([True, True, False, True, False, True])
    routing = router(torch.randn(6, 8))
    balancer(routing, 1, valid_T)
    assert int(seen[0].dropped) == 0
    assert seen[0].per_expert_E.tolist() == torch.bincount(routing.idx_TK[valid_T].reshape(-1), minlength=4).tolist()


# ----------------------------------------------------------------------------- accepted, and why


def _routing(cfg: MoEConfig, x_TD: torch.Tensor):
    torch.manual_seed(0)
    router = Router(8, cfg).train()
    torch.nn.init.normal_(router.weight)
    if router.expert_bias_E is not None:
        router.expert_bias_E.copy_(torch.linspace(-3, 3, cfg.num_experts))  # would reorder any top-k
    return router(x_TD)


def test_round_robin_routing_reads_neither_the_expert_bias_nor_the_groups():
    """The premise of moe.force_balanced's help: with it, a preset's bias and groups route nothing
    (accepted as num_experts=0 keeps a preset's [moe] options, so a real config benchmarks as is)."""
    x_TD = torch.randn(16, 8)
    plain = _routing(MoEConfig(num_experts=8, top_k=2, score_func="sigmoid", force_balanced=True), x_TD)
    for extra in ({"expert_bias": True}, {"num_groups": 4, "group_top_k": 2}):
        other = _routing(MoEConfig(num_experts=8, top_k=2, score_func="sigmoid", force_balanced=True, **extra), x_TD)
        assert torch.equal(other.idx_TK, plain.idx_TK)
        assert torch.equal(other.probs_TK, plain.probs_TK) and torch.equal(other.scores_TE, plain.scores_TE)
    cfg = load_config("tiny-deepseek", {"moe.force_balanced": "true"})
    assert (cfg.moe.expert_bias, cfg.moe.num_groups) == (True, 4)


def _decays(fn, steps: int, warmup: int, **kwargs) -> list[float]:
    return [fn(step, steps=steps, warmup=warmup, **kwargs) for step in range(steps)]


@pytest.mark.parametrize("steps", range(1, 7))
def test_min_lr_ratio_and_decay_fraction_matter_exactly_where_their_help_says(steps):
    """min_lr_ratio: no effect iff steps <= max(warmup, 1); decay_fraction: iff steps <=
    max(warmup + 1, 2), checked against the schedules over every value that could differ."""
    for warmup in range(steps + 1):
        for fn, kw in ((cosine, {}), (wsd, {"decay_fraction": 0.2})):
            ratios = {tuple(_decays(fn, steps, warmup, min_ratio=r, **kw)) for r in (0.0, 0.5)}
            assert (len(ratios) == 1) == (steps <= max(warmup, 1)), (fn.__name__, steps, warmup)
        fractions = {tuple(_decays(wsd, steps, warmup, min_ratio=0.0, decay_fraction=f / 20)) for f in range(1, 21)}
        assert (len(fractions) == 1) == (steps <= max(warmup + 1, 2)), (steps, warmup)


def test_a_one_step_smoke_test_keeps_the_schedule_options_it_cannot_use(tmp_path):
    """Refused, the smoke test of a real config would need their defaults written back, and a run
    reread without more steps (generate, resume) would drop them from its config.toml: a resume
    with a larger train.steps would then decay to another lr than the config's."""
    smoke = {"train.schedule": "wsd", "train.min_lr_ratio": "0.05", "train.decay_fraction": "0.5",
             "train.steps": "1", "train.warmup_steps": "0"}
    path = tmp_path / "config.toml"
    path.write_text(to_toml(load_config("tiny", smoke)))
    cfg, notes = read_run_config(path)
    assert notes == [] and (cfg.train.min_lr_ratio, cfg.train.decay_fraction) == (0.05, 0.5)
