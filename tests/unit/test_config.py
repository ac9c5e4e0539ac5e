import re

import pytest

from moefold.cli import main
from moefold.config import field_docs, field_types, load_config, to_toml
from moefold.errors import ConfigError


def test_defaults_are_the_tiny_preset():
    cfg = load_config()
    assert cfg.moe.num_experts == 8 and cfg.model.dim == 128


def test_dotted_overrides_are_typed():
    cfg = load_config("tiny", {"moe.top_k": "4", "train.lr": "1e-4", "model.qk_norm": "false",
                               "data.path": "x.txt"})
    assert cfg.moe.top_k == 4 and cfg.train.lr == 1e-4 and cfg.model.qk_norm is False
    assert cfg.data.path == "x.txt"


def test_every_field_has_a_docstring():
    assert set(field_docs()) == set(field_types())


def test_toml_round_trip(tmp_path):
    cfg = load_config("tiny", {"moe.top_k": "3", "data.path": 'a "quoted" \\path'})
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    assert load_config(str(path)) == cfg


YARN = {"model.rope_scaling": "yarn", "model.rope_factor": "4"}


@pytest.mark.parametrize("overrides, message", [
    ({"moe.top_k": "9"}, "moe.top_k=9 exceeds moe.num_experts=8"),
    ({"moe.topk": "2"}, "unknown config key moe.topk; did you mean moe.top_k?"),
    ({"train.steps": "0"}, "train.steps=0 must be > 0"),
    ({"train.lr": "fast"}, "train.lr='fast' is not a valid float"),
    ({"model.qk_norm": "maybe"}, "model.qk_norm='maybe' is not a valid bool"),
    ({"model.n_heads": "3"}, "model.n_heads=3 must be a multiple of model.n_kv_heads=2"),
    ({"train.schedule": "linear"}, "train.schedule='linear' is not one of cosine, wsd, constant"),
    ({"parallel.ep": "3"}, "parallel.ep=3 does not divide moe.num_experts=8"),
    ({"parallel.vpp": "0"}, "parallel.vpp=0 must be >= 1"),
    ({"train.global_batch_size": "-8"}, "train.global_batch_size=-8 must be >= 0"),
    ({"moe.dense_layers": "[1, 99]"}, "moe.dense_layers=[1, 99] names a layer that does not exist"),
    ({"train.global_batch_size": "16", "train.grad_accum": "3"},
     "train.grad_accum=3 and train.global_batch_size=16: give one"),
    ({"train.lr": "nan"}, "train.lr=nan must be a finite number"),
    ({"train.seed": str(2**64)}, f"train.seed={2**64} must be < 2**63"),
    ({"moe.capacity_factor": "inf"}, "moe.capacity_factor=inf must be a finite number"),
    ({"moe.capacity_factor": "1", "moe.pad_to_capacity": "true", "parallel.ep": "2",
      "parallel.ep_dispatcher": "allgather"},
     "moe.pad_to_capacity=true under parallel.ep·etp > 1 needs parallel.ep_dispatcher='alltoall', not 'allgather'"),
    ({"model.attention": "mla", "model.qk_nope_head_dim": "-1"}, "model.qk_nope_head_dim=-1 must be >= 0"),
    ({**YARN, "model.yarn_beta_slow": "0"}, "model.yarn_beta_slow=0.0 must be > 0"),
    ({**YARN, "model.yarn_mscale_all_dim": "-1"}, "model.yarn_mscale_all_dim=-1.0 must be >= 0"),
    ({**YARN, "model.rope_theta": "1"}, "model.rope_theta=1.0 must be > 1 for YaRN"),
    ({"moe.dense_layers": "0, 1"}, "moe.dense_layers='0, 1' is not a list (write it as [1, 2])"),
    ({"memory.recompute": "[attn]"}, """memory.recompute='[attn]' is not a list (write it as '["a", "b"]', strings in double quotes)"""),
])
def test_invalid_values_name_field_value_and_rule(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("tiny", overrides)


def test_an_adamw_decay_that_would_zero_or_flip_every_weight_is_refused():
    """AdamW's decoupled decay multiplies each weight by 1 − lr · weight_decay a step: from
    lr · weight_decay = 1 on, that zeroes every decayed weight or flips its sign."""
    load_config("tiny", {"train.lr": "1.98", "train.weight_decay": "0.5"})  # 0.99: shrinks them
    with pytest.raises(ConfigError, match=re.escape(
            "train.lr=2.0 · train.weight_decay=0.5 = 1 must be < 1 (AdamW's decay multiplies each weight by "
            "1 − lr · weight_decay a step: 0 or less zeroes it or flips its sign)")):
        load_config("tiny", {"train.lr": "2", "train.weight_decay": "0.5"})


def test_unknown_preset_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="no such preset or file"):
        load_config("tinyy")
    bad = tmp_path / "bad.toml"
    bad.write_text("[moe\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(str(bad))
    wrong_section = tmp_path / "w.toml"
    wrong_section.write_text("[mod]\ndim = 3\n")
    with pytest.raises(ConfigError, match=r"unknown section \[mod\]; did you mean \[model\]"):
        load_config(str(wrong_section))


def test_a_folder_named_like_a_preset_does_not_hide_it(tmp_path, monkeypatch):
    """`--config tiny` from a folder holding a `tiny/` run dir still means the preset."""
    monkeypatch.chdir(tmp_path)
    preset = load_config("tiny")
    (tmp_path / "tiny").mkdir()
    (tmp_path / "runs").mkdir()
    assert load_config("tiny") == preset
    with pytest.raises(ConfigError, match=re.escape("--config runs: is a folder")):
        load_config("runs")
    with pytest.raises(ConfigError, match=re.escape("--config gone.toml: no such file")):
        load_config("gone.toml")


def test_bad_values_in_a_config_file_name_the_file_and_its_syntax(tmp_path):
    """A file's errors say which file; its list hint is TOML's, without the shell's quotes."""
    listed = tmp_path / "listed.toml"
    listed.write_text('[precision]\nfp8_exclude = "layers.0.*"\n')
    with pytest.raises(ConfigError, match=re.escape(
            f"""--config {listed}: precision.fp8_exclude='layers.0.*' is not a list of str """
            """(write it as ["a", "b"], strings in double quotes)""")):
        load_config(str(listed))
    typed = tmp_path / "typed.toml"
    typed.write_text('[moe]\ntop_k = "two"\n')
    with pytest.raises(ConfigError, match=re.escape(f"--config {typed}: moe.top_k='two' is not a valid int")):
        load_config(str(typed))
    misspelt = tmp_path / "misspelt.toml"
    misspelt.write_text("[moe]\ntopk = 2\n")
    with pytest.raises(ConfigError, match=re.escape(f"--config {misspelt}: unknown config key moe.topk; "
                                                    "did you mean moe.top_k?")):
        load_config(str(misspelt))


def test_config_show_prints_resolved_toml(capsys):
    assert main(["config", "show", "--moe.top_k", "4", "--model.tie_embeddings"]) == 0
    out = capsys.readouterr().out
    assert "[moe]\n" in out and "top_k = 4" in out and "tie_embeddings = true" in out


def test_cli_unknown_option_suggests_closest(capsys):
    assert main(["config", "show", "--moe.topk", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "moefold: error: unknown option --moe.topk; did you mean --moe.top_k?"


def test_help_lists_field_docstrings(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--moe.top_k" in out and "Experts each token is sent to." in out


def test_config_show_prints_both_rank_grids(capsys, tmp_path):
    assert main(["config", "show", "--parallel.tp", "2", "--parallel.ep", "4", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "# parallel layout" in out
    saved = tmp_path / "c.toml"
    saved.write_text(out)  # the grid is TOML comments: the output still loads
    assert load_config(str(saved)).parallel.ep == 4


@pytest.mark.parametrize("name", ["cp", "pp", "vpp"])
def test_training_with_context_or_pipeline_parallelism_is_refused(capsys, tmp_path, name):
    """The planner takes them; training would ignore them (vpp 2 trained as 1)."""
    assert main(["train", "--run-dir", str(tmp_path / "r"), f"--parallel.{name}", "2"]) == 2
    assert f"parallel.{name}=2 is not yet supported in training" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("name", ["cp", "pp", "vpp"])
def test_local_ranks_with_context_or_pipeline_parallelism_are_refused_as_such(capsys, tmp_path, name):
    """`--nproc 2 --parallel.tp 2 --parallel.pp 2` said 'world size 2 is not divisible by tp·cp·pp =
    4', which more ranks would not mend: what no layout of these ranks runs is said first, before
    any rank starts."""
    args = ["--run-dir", str(tmp_path / "r"), "--nproc", "2", "--parallel.tp", "2", f"--parallel.{name}", "2"]
    assert main(["train", *args]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"moefold: error: parallel.{name}=2 is not yet supported in training (only 1)"]
    assert not (tmp_path / "r").exists()


def test_tp_must_divide_the_tokens_of_a_micro_batch_and_the_sequence_under_sp():
    tp2_seq3 = {"parallel.tp": "2", "train.micro_batch_size": "1", "train.seq_len": "3"}
    with pytest.raises(ConfigError, match=re.escape(
            "parallel.sequence_parallel needs train.seq_len=3 divisible by parallel.tp=2")):
        load_config("tiny-qwen3", tp2_seq3)
    with pytest.raises(ConfigError, match=re.escape(
            "parallel.tp=2 does not divide the 3 tokens of a micro-batch")):
        load_config("tiny-qwen3", {**tp2_seq3, "parallel.sequence_parallel": "false"})


def test_mla_heads_are_not_cut_from_model_dim():
    """GQA's head_dim is dim // n_heads; MLA's heads have their own sizes, so 3 heads of a dim-64
    model are fine there and refused only for GQA."""
    cfg = load_config("tiny-deepseek", {"model.n_heads": "3"})
    assert (cfg.model.dim % cfg.model.n_heads, cfg.model.attention) == (1, "mla")
    with pytest.raises(ConfigError, match=re.escape("model.dim=64 is not divisible by model.n_heads=3")):
        load_config("tiny-deepseek", {"model.n_heads": "3", "model.attention": "gqa", "model.rope_scaling": "none"})
