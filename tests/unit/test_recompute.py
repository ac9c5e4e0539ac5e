"""memory.recompute: bit-identical training with every option on qwen3-, deepseek- and mixtral-like
models, MoE recording taken once, fewer saved bytes, and clear config errors."""

import pytest
import torch
from memory_runs import CASES, SavedBytes, assert_identical, batches, build, plain_run, train
from memory_runs import one_thread  # noqa: F401 (autouse fixture)

from moefold.config import load_config
from moefold.errors import ConfigError
from moefold.moe.balance import LocalCounts


@pytest.mark.parametrize("config,name", CASES)
def test_recompute_trains_bit_identically(config, name):
    """Losses, every gradient, MoE statistics, step and global-batch counts, router replay's
    recording and the RNG stream equal the plain run's after two steps of two micro-batches."""
    run = train(build(config, {"memory.recompute": f'["{name}"]'}))
    assert_identical(run, plain_run(config))


def test_combined_fine_grained_recompute_is_bit_identical():
    everything_but_regions = '["norm", "attn_core", "mla_up_proj", "moe_act", "shared_experts", "mlp"]'
    run = train(build("deepseek", {"memory.recompute": everything_but_regions}))
    assert_identical(run, plain_run("deepseek"))


class CountingCounts(LocalCounts):
    """Stands in for DataParallelCounts: each call would be one all-reduce."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        return super().__call__(*args)


@pytest.mark.parametrize("name", ["moe", "layer"])
def test_recomputed_moe_layer_counts_once_per_forward(name):
    """The recompute replays the forward's counts instead of counting (and all-reducing) again,
    and its routing instead of choosing again."""
    model = build("qwen3", {"memory.recompute": f'["{name}"]'})
    counters = [CountingCounts() for _ in model.moe_layers()]
    for layer, counter in zip(model.moe_layers(), counters):
        layer.count_routed = counter
        layer.router.select = _never_called_twice(layer.router.select)
    train(model, steps=1, accum=2)
    assert [c.calls for c in counters] == [2] * len(counters)


def _never_called_twice(select):
    calls = []

    def call(selection_TE):
        calls.append(1)
        assert len(calls) <= 2, "routing chosen again by the recompute"  # 2 micro-batches
        return select(selection_TE)
    return call


@pytest.mark.parametrize("config,name", CASES)
def test_recompute_keeps_fewer_bytes(config, name, monkeypatch):
    ids = batches(1, seq_len=64)[0]  # at 16 tokens the attention probabilities weigh what v does
    plain_model, model = build(config), build(config, {"memory.recompute": f'["{name}"]'})
    plain = SavedBytes(plain_model, monkeypatch).of_forward(plain_model, ids)
    saved = SavedBytes(model, monkeypatch).of_forward(model, ids)
    print(f"{config} {name}: {saved} of {plain} bytes")
    assert saved < plain


def test_output_discarding_frees_what_the_consumer_saved(monkeypatch):
    """The pre-norms' outputs are freed once attention and FFN saved them: fewer bytes than a
    plain checkpoint of the norms, which leaves the consumers' copy alive."""
    ids = batches(1)[0]
    model = build("qwen3", {"memory.recompute": '["norm"]'})
    discarded = SavedBytes(model, monkeypatch).of_forward(model, ids)
    from moefold.memory import recompute

    monkeypatch.setattr(recompute._Run, "discard_until_backward_of", lambda run, out: None)
    kept = SavedBytes(model, monkeypatch).of_forward(model, ids)
    assert discarded < kept


def test_a_recomputed_activation_holds_only_the_inputs_it_reads(monkeypatch):
    """Without the memory-efficient permutation the experts' activation is handed the [R]
    probabilities and ignores them (the combine weighs the rows). Recomputed, it keeps gate and
    up, which the plain run keeps too, and frees silu(gate) and its output h: 2·R·F·4 bytes a
    layer in fp32, and nothing held besides."""
    ids = batches(1)[0]
    combine = {"moe.memory_efficient_permute": "false"}
    plain_model, model = build("qwen3", combine), build("qwen3", {**combine, "memory.recompute": '["moe_act"]'})
    plain = SavedBytes(plain_model, monkeypatch).of_forward(plain_model, ids)
    saved = SavedBytes(model, monkeypatch).of_forward(model, ids)
    T = ids.shape[0] * (ids.shape[1] - 1)
    freed = sum(2 * layer.dispatcher.layout.num_rows(T * layer.top_k) * layer.experts.w2_EFD.shape[1] * 4
                for layer in model.moe_layers())
    assert plain - saved == freed
    assert_identical(train(build("qwen3", {**combine, "memory.recompute": '["moe_act"]'})),
                     train(build("qwen3", combine)))


def test_evaluation_under_no_grad_runs_the_plain_forward():
    model, plain = build("deepseek", {"memory.recompute": '["norm", "moe"]'}), build("deepseek")
    ids = batches(1)[0]
    with torch.no_grad():
        assert torch.equal(model.eval()(ids), plain.eval()(ids))


@pytest.mark.parametrize("overrides,message", [
    ({"memory.recompute": '["attention"]'},
     ("memory.recompute='attention' is not one of norm, attn_core, mla_up_proj, moe_act, "
      "shared_experts, mlp, moe, layer")),
    ({"memory.offload": '["norm", "norm"]'}, "lists 'norm' twice"),
    ({"memory.recompute": '["layer", "norm"]'}, "'layer' already recomputes norm"),
    ({"memory.recompute": '["moe", "moe_act"]'}, "'moe' already recomputes moe_act"),
    ({"memory.recompute": '["mla_up_proj"]'}, "needs model.attention='mla'"),
    ({"memory.offload": '["shared_experts"]'}, "needs moe.shared_experts > 0"),
    ({"memory.recompute": '["moe"]', "memory.offload": '["moe"]'}, "moe is also recomputed"),
    ({"memory.offload_min_bytes": "-1"}, "memory.offload_min_bytes=-1 must be >= 0"),
])
def test_config_errors_name_field_value_and_choices(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_config("tiny-qwen3", overrides)
