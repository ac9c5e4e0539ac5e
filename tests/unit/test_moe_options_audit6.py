"""`build_moe_layer` refuses the [moe] options its layer never reads, as the config does: one
InertOptionError, the same line, from one rule (`validate_moe`). moe.drop_policy without a capacity
factor stays a config check only: `moefold generate` builds its dropless layers with the run's
policy (generate.py's `_dropless`). The random layers of tests/moe_reference.py and
test_expert_parallel.py draw no such option, and each seed keeps the layer it tested."""

import hashlib

import pytest
import torch

from moe_reference import random_config
from test_expert_parallel import random_case
from moefold.config import Config, InertOptionError, MoEConfig, load_config, validate
from moefold.errors import ConfigError
from moefold.moe.layer import _build_shared, build_moe_layer
from moefold.moe.router import Router

# tiny-qwen3's [moe]: no shared experts, softmax then top-k, no expert bias.
TINY_QWEN3 = {"num_experts": 8, "top_k": 2, "expert_hidden": 32, "first_k_dense": 0}

# (the [moe] fields, as a config file or command line gives them, the one line each is refused with)
INERT = [
    ({"shared_expert_gate": True}, "moe.shared_expert_gate=true needs moe.shared_experts > 0"),
    ({"shared_expert_hidden": 24}, "moe.shared_expert_hidden=24 needs moe.shared_experts > 0"),
    ({"expert_bias_update_rate": 0.01},
     "moe.expert_bias_update_rate=0.01 needs moe.expert_bias=true (no expert bias to update)"),
    ({"softmax_before_topk": False, "norm_topk_prob": False},
     "moe.norm_topk_prob=false needs moe.softmax_before_topk=true (a softmax over the K chosen sums to 1 "
     "already)"),
]


def _raised(build) -> InertOptionError:
    with pytest.raises(InertOptionError) as err:
        build()
    return err.value


@pytest.mark.parametrize("fields, message", INERT, ids=[next(iter(f)) if len(f) == 1 else "norm_topk_prob"
                                                        for f, _ in INERT])
def test_build_moe_layer_refuses_an_inert_option_as_the_config_does(fields, message):
    moe = MoEConfig(**TINY_QWEN3, **fields)
    from_layer = _raised(lambda: build_moe_layer(64, moe, "cpu", torch.float32))
    overrides = {f"moe.{k}": str(v).lower() for k, v in fields.items()}
    from_config = _raised(lambda: load_config("tiny-qwen3", overrides))
    assert str(from_layer) == str(from_config) == message
    assert (from_layer.key, from_layer.unset) == (from_config.key, from_config.unset)


def _error(call) -> str | None:
    try:
        call()
    except ConfigError as error:
        return str(error)
    return None


@pytest.mark.parametrize("context", [{}, {"shared_experts": 1}, {"expert_bias": True},
                                     {"softmax_before_topk": False}], ids=lambda c: str(c or "defaults"))
@pytest.mark.parametrize("key, value", [("shared_expert_gate", True), ("shared_expert_gate", False),
                                        ("shared_expert_hidden", 0), ("shared_expert_hidden", 24),
                                        ("shared_expert_hidden", -1), ("expert_bias_update_rate", 0.5),
                                        ("expert_bias_update_rate", 1e-3), ("expert_bias_update_rate", -1.0),
                                        ("norm_topk_prob", False), ("norm_topk_prob", True)])
def test_build_moe_layer_and_load_config_agree_on_every_value_in_every_context(context, key, value):
    """test_config_coherence2's sweep, for the options it leaves out as unread: the same line or none."""
    moe = {**TINY_QWEN3, **context, key: value}
    loaded = _error(lambda: load_config("tiny-qwen3", {f"moe.{k}": str(v).lower() for k, v in moe.items()}))
    built = _error(lambda: build_moe_layer(64, MoEConfig(**moe), "cpu", torch.float32, init_std=None))
    assert built == loaded


@pytest.mark.parametrize("fields, read", [
    ({"shared_experts": 1, "shared_expert_gate": True}, lambda layer: hasattr(layer.shared, "gate")),
    ({"shared_experts": 1, "shared_expert_hidden": 24}, lambda layer: layer.shared.w1.out_features == 24),
    ({"expert_bias": True, "expert_bias_update_rate": 0.01},
     lambda layer: layer.router.expert_bias_update_rate == 0.01),
    ({"norm_topk_prob": False}, lambda layer: layer.router.renormalize.__name__ == "keep_probs"),
])
def test_the_same_options_where_the_layer_reads_them_are_built(fields, read):
    assert read(build_moe_layer(64, MoEConfig(**TINY_QWEN3, **fields), "cpu", torch.float32))


def test_a_drop_policy_without_capacity_is_still_built():
    """generate.py's `_dropless` keeps the run's drop_policy and sets capacity_factor=0; the config
    (not the layer) refuses the pair."""
    layer = build_moe_layer(64, MoEConfig(**TINY_QWEN3, drop_policy="position"), "cpu", torch.float32)
    assert layer.capacity is not None
    with pytest.raises(InertOptionError, match="^moe.drop_policy='position' needs moe.capacity_factor > 0"):
        load_config("tiny-qwen3", {"moe.drop_policy": "position"})


# ----------------------------------------------------------------------------- the rules' premises


def test_without_shared_experts_neither_gate_nor_hidden_builds_anything():
    assert _build_shared(64, MoEConfig(shared_experts=0, shared_expert_gate=True, shared_expert_hidden=24)) is None


def test_without_the_expert_bias_the_update_rate_changes_nothing():
    router = Router(16, MoEConfig(num_experts=4, top_k=2, expert_bias=False, expert_bias_update_rate=0.5))
    state = {k: v.clone() for k, v in router.state_dict().items()}
    router.update_expert_bias(torch.tensor([9, 0, 0, 3]))
    assert router.expert_bias_E is None
    assert all(torch.equal(v, state[k]) for k, v in router.state_dict().items())


def test_after_a_softmax_over_the_k_chosen_renormalising_changes_nothing():
    """Mixtral's order: the K weights sum to 1 already (to a rounding of the division)."""
    routers = []
    for norm in (True, False):
        torch.manual_seed(0)
        routers.append(Router(16, MoEConfig(num_experts=8, top_k=3, softmax_before_topk=False, norm_topk_prob=norm,
                                            router_dtype="fp64")))
        torch.nn.init.normal_(routers[-1].weight)
    x_TD = torch.randn(32, 16, dtype=torch.float64)
    with_norm, without = (router(x_TD) for router in routers)
    assert torch.equal(with_norm.idx_TK, without.idx_TK)
    torch.testing.assert_close(with_norm.probs_TK, without.probs_TK, rtol=1e-15, atol=0)


# ----------------------------------------------------------------------------- random layers


@pytest.mark.parametrize("seed", range(64))
def test_random_config_draws_only_options_a_model_config_accepts(seed):
    validate(Config(moe=random_config(seed)))


def _expert_parallel_cases() -> list:
    """The seeds test_expert_parallel.py and test_allgather_dispatcher.py draw."""
    cases = [random_case(world * 1000 + seed, world, (0, 0, 8)) for world in (2, 4) for seed in range(16)]
    return cases + [random_case(world * 2000 + seed, world, (0, 0, 8), capacity=True)
                    for world in (2, 4) for seed in range(12)]


def test_random_case_draws_only_options_a_model_config_accepts():
    for case in _expert_parallel_cases():
        validate(Config(moe=case.cfg))


# The fields random_config draws; those it leaves inert (a gate without shared experts, the
# renormalisation after a softmax over the K chosen) are left out of the fingerprint.
_DRAWN = ("num_experts", "top_k", "expert_hidden", "score_func", "norm_topk_prob", "routed_scaling_factor",
          "expert_bias", "activation", "memory_efficient_permute", "pad_multiple", "shared_experts",
          "shared_expert_gate", "router_dtype", "softmax_before_topk", "num_groups", "group_top_k",
          "capacity_factor", "drop_policy", "pad_to_capacity")


def _meaningful(cfg: MoEConfig) -> dict:
    drawn = {key: getattr(cfg, key) for key in _DRAWN}
    if cfg.shared_experts == 0:
        del drawn["shared_expert_gate"]
    if cfg.score_func == "softmax" and not cfg.softmax_before_topk:
        del drawn["norm_topk_prob"]
    return drawn


def test_random_config_keeps_every_seeds_meaningful_options():
    """The digest of seeds 0-63's read options as random_config drew them before it dropped the
    inert ones (at 35bd959): each seed still tests the layer it tested."""
    fingerprint = repr([_meaningful(random_config(seed)) for seed in range(64)])
    assert hashlib.sha256(fingerprint.encode()).hexdigest()[:16] == "f7824d9c4f9e0f98"


def test_random_case_keeps_every_seeds_meaningful_options_and_batch():
    """As above for test_expert_parallel's cases: options (the experts backend, which depends on the
    torch build, left out), token counts, starved experts and padding."""
    fingerprint = repr([(_meaningful(c.cfg), c.tokens_per_rank, c.starved, c.padding)
                        for c in _expert_parallel_cases()])
    assert hashlib.sha256(fingerprint.encode()).hexdigest()[:16] == "b8e0dc1df446213c"
