"""Config edges: `moefold config show` output read back with --config, and config files the user
got wrong (each a one-line error naming the file, exit 2)."""

import pytest

from moefold.cli import main
from moefold.config import load_config


def _show_and_read_back(tmp_path, capsys, args: list[str]):
    assert main(["config", "show", *args]) == 0
    shown = tmp_path / "shown.toml"
    shown.write_text(capsys.readouterr().out)
    assert main(["config", "show", "--config", str(shown)]) == 0
    return shown, capsys.readouterr()


def test_show_reads_back_strings_with_control_characters(tmp_path, capsys):
    """A file name may hold a newline or any control character; TOML's basic strings take them
    only escaped."""
    path = "runs/new\nline\x01\x1f\x7f\ttab\\\"q\u2028"
    shown, read_back = _show_and_read_back(tmp_path, capsys, ["--data.path", path, "--data.text_field", "a\rb"])
    assert read_back.err == ""
    cfg = load_config(str(shown))
    assert (cfg.data.path, cfg.data.text_field) == (path, "a\rb")
    assert cfg == load_config(None, {"data.path": path, "data.text_field": "a\rb"})


def test_a_config_file_that_is_not_utf8_is_a_one_line_error(tmp_path, capsys):
    """A Latin-1 comment (or any non-UTF-8 byte) ended in a UnicodeDecodeError traceback."""
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes("# réglages\n[model]\ndim = 64\n".encode("latin-1"))
    assert main(["config", "show", "--config", str(latin1)]) == 2
    err = capsys.readouterr().err
    assert err == f"moefold: error: --config {latin1}: not UTF-8 text (byte 3: b'\\xe9'); TOML files are UTF-8\n"


def test_a_quoted_number_or_bool_in_a_config_file_is_refused_naming_its_type(tmp_path, capsys):
    """TOML values are typed: '4' in quotes is a string, which the command line's text parsing
    used to turn into the int (or float, or bool) the field wants without a word."""
    for line, message in (('[model]\ndim = "64"', "model.dim='64' is not a valid int"),
                          ('[train]\nlr = "1e-3"', "train.lr='1e-3' is not a valid float"),
                          ('[model]\nqk_norm = "false"', "model.qk_norm='false' is not a valid bool")):
        quoted = tmp_path / "quoted.toml"
        quoted.write_text(line + "\n")
        assert main(["config", "show", "--config", str(quoted)]) == 2
        assert capsys.readouterr().err == f"moefold: error: --config {quoted}: {message}\n"
    assert load_config(None, {"model.dim": "64", "train.lr": "1e-3", "model.qk_norm": "false"}).model.dim == 64



@pytest.mark.parametrize("command", [["train", "--resume", "{run}"],
                                     ["generate", "--run-dir", "{run}", "--prompt", "a"]])
def test_a_saved_runs_broken_config_is_named_as_its_file_not_a_config_option(tmp_path, capsys, command):
    """A run's config.toml (read by --resume or --run-dir) that does not parse was reported as
    `--config RUN/config.toml`, an option the user never gave; the error names the file."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("[model]\ndim = 64\n[model]\n")
    assert main([arg.format(run=run) for arg in command]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moefold: error: {run / 'config.toml'}: invalid TOML: ") and "--config" not in err
    (run / "config.toml").write_text('[model]\ndim = "64"\n')
    assert main([arg.format(run=run) for arg in command]) == 2
    assert capsys.readouterr().err == f"moefold: error: {run / 'config.toml'}: model.dim='64' is not a valid int\n"

def test_no_routed_experts_makes_a_grouped_router_preset_dense():
    """moe.num_experts=0 makes every layer dense, as the ep/etp checks say; on a preset with
    grouped routing (DeepSeek-V3's 8 groups) it was refused as 'moe.group_score_top_k=2 exceeds
    the 0 experts of a group', about a router the model no longer has. top_k is likewise left
    unchecked without experts."""
    from moefold.config import moe_layers_in
    from moefold.errors import ConfigError

    cfg = load_config("deepseek-v3", {"moe.num_experts": 0})
    assert cfg.moe.num_groups == 8 and moe_layers_in(cfg, range(cfg.model.n_layers)) == 0
    with pytest.raises(ConfigError, match=r"^moe.group_score_top_k=2 exceeds the 1 experts of a group$"):
        load_config("deepseek-v3", {"moe.num_experts": 8})  # with experts the groups are checked
