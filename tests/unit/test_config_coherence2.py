"""Options without effect in the config itself are refused in one line (as drop_policy without a
capacity factor is); a resumed run's saved config.toml that an older moefold wrote with such an
option still resumes, the option dropped with a note. Options whose effect depends on the launch's
layout or device get a startup note, never a refusal. `build_moe_layer` initialises its weights;
`apply_recompute` / `apply_offload` refuse unknown names as the config does."""

import math
import re

import pytest
import torch

from moefold.cli import main
from moefold.config import MEMORY_MODULES, MoEConfig, load_config
from moefold.errors import ConfigError


def refused(overrides: dict, message: str, preset: str = "tiny-qwen3") -> None:
    with pytest.raises(ConfigError) as err:
        load_config(preset, overrides)
    assert str(err.value) == message
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------- inert options


def test_offload_min_bytes_without_offload_is_refused():
    """Without memory.offload no tensor moves, so the size threshold chose nothing: a run with it
    trained bit for bit as one without."""
    refused({"memory.offload_min_bytes": "4096"},
            "memory.offload_min_bytes=4096 needs memory.offload (no module's activations move to the host)")
    load_config("tiny-qwen3", {"memory.offload_min_bytes": "4096", "memory.offload": '["moe"]'})
    load_config("tiny-qwen3", {"memory.offload_min_bytes": "1048576"})  # the default, which a preset may state


def test_the_off_switches_of_validation_and_experts_keep_their_presets_options():
    """Not refused: data.val_fraction=0 is how the loader's own error says to turn validation off,
    and tiny-qwen3 sets train.val_every=25; moe.num_experts=0 turns a MoE preset dense (every
    [moe] option of the preset then unread). Refusing either would make the switch a second error."""
    cfg = load_config("tiny-qwen3", {"data.val_fraction": "0"})
    assert cfg.train.val_every == 25
    load_config("tiny-qwen3", {"moe.num_experts": "0"})


# ----------------------------------------------------------------------------- resume


@pytest.fixture
def finished_run(tmp_path, tiny_args):
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--train.steps", "3"]) == 0
    return run


def _save_inert_options(run) -> None:
    """What an older moefold accepted and wrote: fp8_exclude with fp8=off (refused since 5dd6c03),
    and a decay fraction under the cosine schedule."""
    path = run / "config.toml"
    text = path.read_text()
    assert "fp8_exclude = []\n" in text and "decay_fraction = 0.2\n" in text
    path.write_text(text.replace("fp8_exclude = []\n", 'fp8_exclude = ["layers.0.*"]\n')
                    .replace("decay_fraction = 0.2\n", "decay_fraction = 0.3\n"))


def test_a_resume_drops_the_inert_options_its_saved_config_holds_with_a_note(finished_run, capsys):
    _save_inert_options(finished_run)
    assert main(["generate", "--run-dir", str(finished_run), "--prompt", "a", "--max-new-tokens", "2",
                 "--device", "cpu"]) == 0  # the same reader: the options dropped
    capsys.readouterr()
    assert main(["train", "--resume", str(finished_run), "--train.steps", "4"]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if "drops it" in line]
    assert sorted(notes) == [
        f"note: {finished_run / 'config.toml'}: precision.fp8_exclude=['layers.0.*'] needs precision.fp8 "
        "(tensorwise, rowwise, blockwise), not 'off'; the resumed run drops it",
        f"note: {finished_run / 'config.toml'}: train.decay_fraction=0.3 needs train.schedule='wsd'; the "
        "resumed run drops it"], out
    text = (finished_run / "config.toml").read_text()  # rewritten without them: said once
    assert "fp8_exclude = []\n" in text and "decay_fraction = 0.2\n" in text


def test_an_inert_option_given_on_the_command_line_or_to_a_fresh_run_is_refused(finished_run, tmp_path, capsys):
    _save_inert_options(finished_run)
    capsys.readouterr()
    assert main(["train", "--resume", str(finished_run), "--train.steps", "4",
                 "--precision.fp8_exclude", '["layers.1.*"]']) == 2
    err = capsys.readouterr().err
    assert err == ("moefold: error: precision.fp8_exclude=['layers.1.*'] needs precision.fp8 "
                   "(tensorwise, rowwise, blockwise), not 'off'\n"), err
    assert main(["train", "--run-dir", str(tmp_path / "fresh"), "--config", str(finished_run / "config.toml")]) == 2
    assert capsys.readouterr().err == "moefold: error: train.decay_fraction=0.3 needs train.schedule='wsd'\n"


# ----------------------------------------------------------------------------- startup notes


def _notes(capsys, tiny_args, tmp_path, *extra) -> list[str]:
    capsys.readouterr()
    assert main(["train", "--run-dir", str(tmp_path / "run"), *tiny_args, "--train.steps", "2", *extra]) == 0
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]


def test_offload_on_the_cpu_says_it_moves_nothing(tmp_path, tiny_args, capsys):
    notes = _notes(capsys, tiny_args, tmp_path, "--memory.offload", '["moe"]', "--memory.offload_min_bytes", "0")
    assert notes == ["note: memory.offload=['moe'] has no effect on the CPU (its activations are in host "
                     "memory already)"], notes
    assert _notes(capsys, tiny_args, tmp_path / "plain") == []


def test_a_dispatcher_without_expert_parallelism_gets_a_note_not_a_refusal(tmp_path, tiny_args, capsys):
    """parallel.ep_dispatcher acts only under ep·etp > 1, which one config file may be launched with
    or not: said, as Megatron-Core says sequence parallelism is off at tp=1."""
    notes = _notes(capsys, tiny_args, tmp_path, "--parallel.ep_dispatcher", "allgather")
    assert notes == ["note: parallel.ep_dispatcher='allgather' has no effect at parallel.ep·etp = 1 "
                     "(every expert is this rank's)"], notes


# ----------------------------------------------------------------------------- build_moe_layer


def test_build_moe_layer_initialises_its_weights_as_the_model_does():
    """The router and experts were torch.empty: whatever the allocator held. Now Normal(0,
    init_std), the down-projections scaled by 1/sqrt(2) as a one-block model's residual outputs;
    seeded, so two builds agree."""
    from moefold.moe.layer import build_moe_layer

    moe = MoEConfig(num_experts=8, top_k=2, expert_hidden=64, shared_experts=1, expert_bias=True)
    torch.manual_seed(0)
    torch.empty(1 << 20).fill_(float("nan"))  # what an uninitialised weight would read back
    layer = build_moe_layer(64, moe, "cpu", torch.float32, init_std=0.05, seed=3)
    again = build_moe_layer(64, moe, "cpu", torch.float32, init_std=0.05, seed=3)
    for (name, p), q in zip(layer.named_parameters(), again.parameters(), strict=True):
        std = 0.05 / math.sqrt(2) if re.search(r"w2(_EFD|\.weight)$", name) else 0.05
        assert torch.isfinite(p).all(), name
        assert abs(p.std().item() / std - 1) < 0.1 and abs(p.mean().item()) < std / 10, (name, p.std())
        assert torch.equal(p, q), name
    assert torch.equal(layer.router.expert_bias_E, torch.zeros(8))
    other = build_moe_layer(64, moe, "cpu", torch.float32, init_std=0.05, seed=4)
    assert not torch.equal(other.experts.w1_EDF, layer.experts.w1_EDF)


# ----------------------------------------------------------------------------- memory from Python


@pytest.mark.parametrize("apply", ["recompute", "offload"])
def test_an_unknown_memory_name_from_python_is_refused_in_one_line(apply):
    from moefold.memory.offload import apply_offload
    from moefold.memory.recompute import apply_recompute
    from moefold.models.transformer import build_model

    with torch.device("meta"):
        model = build_model(load_config("tiny"), 256)
    call = {"recompute": lambda names: apply_recompute(model, names),
            "offload": lambda names: apply_offload(model, names, 0, "cpu")}[apply]
    allowed = ", ".join(MEMORY_MODULES)
    with pytest.raises(ConfigError) as err:
        call(["moe_ac"])
    assert str(err.value) == f"memory.{apply}='moe_ac' is not one of {allowed}"
    with pytest.raises(ConfigError) as err:
        call("moe")  # a name where a list belongs: read letter by letter
    assert str(err.value) == f"memory.{apply}='moe' is not a list of names (any of {allowed})"


def test_a_saved_option_inert_twice_over_is_dropped_piece_by_piece(tmp_path):
    """memory.recompute=['mla_up_proj', 'layer', 'norm'] in a GQA model: no MLA up-projection, and
    'layer' recomputes the norms already; two drops of the same option, each a different part."""
    from moefold.config import read_run_config, to_toml

    path = tmp_path / "config.toml"
    path.write_text(to_toml(load_config("tiny")).replace(
        "recompute = []", 'recompute = ["mla_up_proj", "layer", "norm"]'))
    cfg, notes = read_run_config(path)
    assert cfg.memory.recompute == ["layer"]
    assert len(notes) == 2 and "memory.recompute='mla_up_proj' does nothing here" in notes[0], notes
    assert "memory.recompute=['layer', 'norm']: 'layer' already recomputes norm" in notes[1], notes


@pytest.mark.parametrize("names, message", [
    (["norm", "norm"], "memory.recompute=['norm', 'norm'] lists 'norm' twice"),
    (["layer", "moe_act"], "memory.recompute=['layer', 'moe_act']: 'layer' already recomputes moe_act; "
                           "list only one of them"),
    (["moe", "moe_act"], "memory.recompute=['moe', 'moe_act']: 'moe' already recomputes moe_act; "
                         "list only one of them"),
])
def test_names_recomputed_twice_from_python_are_refused_as_the_config_refuses_them(names, message):
    """Wrapped twice, an output-discarding site (norm, moe_act) inside another recompute stopped the
    first backward with a RuntimeError ('size does not match, self was 0 bytes but src was 4096
    bytes', 'setStorage: sizes [16, 64] ...')."""
    from moefold.memory.recompute import apply_recompute
    from moefold.models.transformer import build_model

    with torch.device("meta"):
        model = build_model(load_config("tiny"), 256)
    with pytest.raises(ConfigError) as err:
        apply_recompute(model, names)
    assert str(err.value) == message
    refused({"memory.recompute": str(names).replace("'", '"')}, message, preset="tiny")


def test_recomputing_again_what_the_model_recomputes_is_refused():
    """build_model applied memory.recompute=['norm']; a second apply_recompute(model, ['norm'])
    wrapped the norms twice and the first backward stopped with 'size does not match, self was 0
    bytes but src was 4096 bytes'; ['moe'] over a recomputed 'moe_act' with 'setStorage: ...'."""
    from moefold.memory.recompute import apply_recompute
    from moefold.models.transformer import build_model

    for built, again, message in (
            ("norm", "norm", "memory.recompute=['norm', 'norm'] lists 'norm' twice"),
            ("moe_act", "moe", "memory.recompute=['moe_act', 'moe']: 'moe' already recomputes moe_act; "
                               "list only one of them")):
        with torch.device("meta"):
            model = build_model(load_config("tiny", {"memory.recompute": f'["{built}"]'}), 256)
        with pytest.raises(ConfigError) as err:
            apply_recompute(model, [again])
        assert str(err.value) == message
        apply_recompute(model, ["attn_core"])  # another name is still taken


@pytest.mark.parametrize("apply", ["recompute", "offload"])
@pytest.mark.parametrize("name", ["mla_up_proj", "shared_experts"])
def test_a_memory_name_without_a_site_from_python_is_refused(apply, name):
    """On tiny (GQA, no shared experts) the name wrapped nothing and said nothing; the config
    refuses it ('does nothing here')."""
    from moefold.memory.offload import apply_offload
    from moefold.memory.recompute import apply_recompute
    from moefold.models.transformer import build_model

    with torch.device("meta"):
        model = build_model(load_config("tiny"), 256)
    with pytest.raises(ConfigError) as err:
        (apply_recompute(model, [name]) if apply == "recompute" else apply_offload(model, [name], 0, "cpu"))
    assert str(err.value) == (f"memory.{apply}={name!r} does nothing here: the model has no {name} site "
                              "(memory/sites.py)")
    with pytest.raises(ConfigError, match=rf"^memory.{apply}={name!r} does nothing here: "):
        load_config("tiny", {f"memory.{apply}": f'["{name}"]'})


# What build_moe_layer may take that load_config refuses: options of the whole model's layer
# pattern, and drop_policy without a capacity, which a layer leaves unread (docs/python.md: `moefold
# generate` builds its dropless layers with the run's drop_policy); its "> 0 for an MoE layer" words 0 experts' refusal its way.
_MODEL_WIDE = {"first_k_dense", "moe_every", "dense_layers"}
_UNREAD = {"drop_policy"}
_VALUES = {int: [-1, 0, 1, 3, 9, 2**64], float: [-1.0, 0.0, 0.5, 2.0, float("nan"), float("inf")],
           bool: [True, False], str: ["bogus", "sigmoid", "position", "gelu", "loop", "fp64"]}


def test_build_moe_layer_refuses_each_moe_value_load_config_refuses_in_its_words():
    """Every [moe] field at values around its limits (one at a time, on 8 experts of top-2)."""
    import dataclasses

    from moefold.config import field_types
    from moefold.moe.layer import build_moe_layer

    def error(call):
        try:
            call()
        except ConfigError as e:
            return str(e)
        return None

    base = {"num_experts": 8, "top_k": 2, "expert_hidden": 8}
    checked = 0
    for f in dataclasses.fields(MoEConfig):
        if f.name in _MODEL_WIDE | _UNREAD or field_types()[f"moe.{f.name}"] not in _VALUES:
            continue
        for value in _VALUES[field_types()[f"moe.{f.name}"]]:
            moe = {**base, f.name: value}
            loaded = error(lambda: load_config("tiny", {f"moe.{k}": v for k, v in moe.items()}))
            built = error(lambda: build_moe_layer(8, MoEConfig(**moe), "cpu", torch.float32, init_std=None))
            if f.name in base and value in (0, -1):  # 0 experts is a dense model's config, not a layer's
                assert built == f"moe.{f.name}={value} must be > 0 for an MoE layer", built
            else:
                assert built == loaded, (f.name, value)
            checked += loaded is not None
    assert checked > 40


def test_the_saved_options_are_judged_with_the_overrides(tmp_path):
    """A saved option an override gives an effect is kept (fp8_exclude with --precision.fp8
    rowwise); one a saved error hid is still dropped when an override mends that error."""
    from moefold.config import read_run_config, to_toml

    path = tmp_path / "config.toml"
    path.write_text(to_toml(load_config("tiny")).replace("fp8_exclude = []", 'fp8_exclude = ["layers.0.*"]'))
    cfg, notes = read_run_config(path, {"precision.fp8": "rowwise"})
    assert cfg.precision.fp8_exclude == ["layers.0.*"] and notes == []
    path.write_text(path.read_text().replace("lr = 0.003\n", "lr = nan\n", 1))
    cfg, notes = read_run_config(path, {"train.lr": "1e-3"})
    assert cfg.precision.fp8_exclude == [] and len(notes) == 1 and "precision.fp8_exclude" in notes[0], notes
