"""The refusal of a model that cannot fit (plan/fit.py): its floor against the bytes a real step
holds, the parameter count it rests on against the built model, the memory it reads, and the CLI."""

import pytest

from moefold.cli import main
from moefold.config import load_config
from moefold.errors import ConfigError
from moefold.models.transformer import is_moe_layer
from moefold.plan.fit import Capacity, host_memory_bytes, refuse_model_beyond_memory
from moefold.plan.params import embedding_params, head_params, layer_params, model_params, moe_layer_count
from conftest import TINY_OVERRIDES, floor_and_held_after_a_step


@pytest.mark.parametrize("preset, overrides", [
    ("tiny-deepseek", {}),
    ("tiny-deepseek", {"moe.first_k_dense": 3, "moe.moe_every": 2, "moe.dense_layers": [4, 7, 10]}),
    ("tiny-deepseek", {"moe.first_k_dense": 20}),  # no MoE layer
    ("tiny-deepseek", {"model.mtp_layers": 2, "moe.moe_every": 3}),
    ("tiny", {"moe.num_experts": 0}),
])
def test_moe_layers_and_parameters_are_counted_without_visiting_each_layer(preset, overrides):
    """The closed-form count against is_moe_layer at every block, and model_params against the sum
    of every block's own count (the meta-built model is the reference in test_plan_memory)."""
    cfg = load_config(preset, {"model.n_layers": 11, **overrides})
    blocks = range(cfg.model.n_layers + cfg.model.mtp_layers)
    assert moe_layer_count(cfg) == sum(is_moe_layer(cfg, i) for i in blocks)
    visited = embedding_params(cfg, 257) + head_params(cfg, 257)
    for layer_id in blocks:
        visited += layer_params(cfg, layer_id)
    assert model_params(cfg, 257) == visited


def test_a_model_of_a_hundred_million_layers_is_counted_at_once():
    cfg = load_config("tiny", {"model.n_layers": 10**8})
    small = load_config("tiny", {"model.n_layers": 5})
    smaller = load_config("tiny", {"model.n_layers": 4})
    per_moe_block = model_params(small, 257).total - model_params(smaller, 257).total
    assert model_params(cfg, 257).total == model_params(small, 257).total + (10**8 - 5) * per_moe_block


@pytest.mark.parametrize("optim", [
    {},
    {"optim.master_dtype": "bf16"},  # bf16 parameters under fp32 compute
    {"optim.master_dtype": "bf16", "precision.compute_dtype": "bf16"},
    {"optim.master_dtype": "bf16+remainder", "precision.compute_dtype": "bf16"},
    {"optim.exp_avg_dtype": "bf16", "optim.exp_avg_sq_dtype": "fp8"},
])
def test_the_floor_is_what_one_process_holds_after_a_step(tmp_path, text_corpus, optim):
    """The floor never exceeds what a step holds (a refused run could never have run) and is most
    of it (one process: no replicas, no activations counted)."""
    floor, held = floor_and_held_after_a_step(tmp_path / "run", {
        **TINY_OVERRIDES, "data.path": str(text_corpus), "model.dim": "128", "moe.expert_hidden": "128",
        "model.ffn_hidden": "256", **optim})
    assert 0.9 * held <= floor <= held, (floor, held)


def test_host_memory_reads_meminfo_and_the_cgroup_limits(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384 kB\nMemFree:  1 kB\nSwapTotal:        2048 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert host_memory_bytes(meminfo, cgroup) == (16384 + 2048) * 1024  # no limit files: the host's
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.swap.max").write_text("0\n")
    assert host_memory_bytes(meminfo, cgroup) == 16384 * 1024
    (cgroup / "memory.max").write_text(f"{4096 * 1024}\n")
    assert host_memory_bytes(meminfo, cgroup) == 4096 * 1024
    assert host_memory_bytes(tmp_path / "missing", cgroup) is None


def test_the_refusal_is_at_the_floor_and_counts_the_ranks_sharing_a_host():
    cfg = load_config("tiny")
    floor = model_params(cfg, 257).total * 16  # fp32 weights, gradients and moments
    refuse_model_beyond_memory(cfg, 257, 1, Capacity(floor, 1, "x"))
    with pytest.raises(ConfigError, match="need at least .* GiB for their weights"):
        refuse_model_beyond_memory(cfg, 257, 1, Capacity(floor - 1, 1, "x"))
    refuse_model_beyond_memory(cfg, 257, 4, Capacity(floor // 4 + 1, 1, "one GPU"))
    with pytest.raises(ConfigError, match="on the 4 ranks this host runs"):
        refuse_model_beyond_memory(cfg, 257, 8, Capacity(floor // 2 - 1, 4, "the host"))
    refuse_model_beyond_memory(cfg, 257, 8, None)  # unknown capacity: no check


@pytest.mark.parametrize("nproc", [[], ["--nproc", "2", "--parallel.ep", "2"]])
@pytest.mark.parametrize("blocks", ["model.n_layers", "model.mtp_layers"])
def test_a_model_beyond_the_host_is_refused_before_it_is_built(tmp_path, tiny_args, capsys, nproc, blocks):
    """10^8 blocks (or MTP modules): refused from the config alone (building them would take
    hours, and so would counting them one by one), one line, exit 2, nothing written; with
    --nproc before any rank starts."""
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["train", "--run-dir", str(run), *tiny_args, f"--{blocks}", str(10**8), *nproc]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "this host has" in err and "model.n_layers" in err
    assert not run.exists()
