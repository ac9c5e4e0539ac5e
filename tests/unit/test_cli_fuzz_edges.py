"""Edge values the command-line fuzz (every subcommand × every option × bad values) found
mishandled: each is now one line naming the option and what is allowed, exit status 2."""

import pytest

from moefold.cli import main
from moefold.config import field_types

INT_OPTIONS = [key for key, tp in field_types().items() if tp is int]


def _one_error_line(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.mark.parametrize("key", INT_OPTIONS)
@pytest.mark.parametrize("value, bound", [(2**63, "< 2**63"), (-2**63 - 1, ">= -2**63")])
def test_an_integer_beyond_64_bits_is_refused_naming_the_option(capsys, key, value, bound):
    """Python's ints are unbounded, torch's are int64: 2**63 passed validation for most options
    (train.seq_len, model.sliding_window, the MLA sizes unused under GQA, ...) and model.n_layers,
    model.mtp_layers, model.dim ended `config params` in an OverflowError traceback."""
    line = _one_error_line(capsys, ["config", "show", f"--{key}", str(value)])
    assert line == f"moefold: error: {key}={value} must be {bound} (a 64-bit integer)"


@pytest.mark.parametrize("key", ["model.n_layers", "model.mtp_layers", "model.dim", "moe.num_experts"])
def test_config_params_of_a_size_beyond_64_bits_is_one_line(capsys, key):
    assert "must be < 2**63" in _one_error_line(capsys, ["config", "params", f"--{key}", str(2**63)])


def test_config_params_of_a_weight_beyond_64_bits_is_one_line(capsys):
    """Sizes each within int64 whose product is not: a [4e9, 4e9] weight cannot be made even on
    the meta device, and `config params` ended in torch's RuntimeError traceback."""
    line = _one_error_line(capsys, ["config", "params", "--model.dim", "4000000000", "--model.ffn_hidden", "4000000000"])
    assert line == ("moefold: error: a weight of this model would hold more elements than a tensor can (torch: "
                    "Storage size calculation overflowed with sizes=[4000000000, 4000000000]); make model.dim, "
                    "model.ffn_hidden, moe.expert_hidden or the vocabulary smaller")


def test_the_largest_64_bit_integer_is_still_an_allowed_value():
    from moefold.config import load_config

    assert load_config("tiny", {"train.seed": str(2**63 - 1)}).train.seed == 2**63 - 1
    assert load_config("tiny", {"checkpoint.every": str(2**63 - 1)}).checkpoint.every == 2**63 - 1


@pytest.mark.parametrize("command", [["config", "show"], ["config", "params"]])
@pytest.mark.parametrize("n_layers, mtp_layers", [(2, 2**63 - 1), (2**63 - 1, 1)])
def test_layers_and_mtp_layers_beyond_64_bits_together_are_refused(capsys, command, n_layers, mtp_layers):
    """Each within int64, their sum not: the layer checks' range(n_layers + mtp_layers) ended in
    'OverflowError: Python int too large to convert to C ssize_t' (a traceback, in every command)."""
    line = _one_error_line(capsys, [*command, "--model.n_layers", str(n_layers), "--model.mtp_layers", str(mtp_layers)])
    assert line == (f"moefold: error: model.n_layers + model.mtp_layers = {n_layers + mtp_layers} "
                    "must be < 2**63 (a 64-bit integer)")


@pytest.mark.parametrize("theta", ["1e-300", "5e-324", "1e-30", "0.5", "1"])
def test_a_rope_theta_of_one_or_less_is_refused(capsys, theta):
    """It validated (only > 0 was asked without YaRN); 1e-300 then trained to a nan gradient norm
    in step 1 and the run stopped as 'training diverged ... lower train.lr', the wrong option."""
    line = _one_error_line(capsys, ["config", "show", "--model.rope_theta", theta])
    assert line == f"moefold: error: model.rope_theta={float(theta)} must be > 1 (RoPE's base; models use 1e4 to 1e6)"


ONE_STEP = ["--train.steps", "1", "--train.warmup_steps", "0", "--train.device", "cpu", "--model.n_layers", "1",
            "--moe.first_k_dense", "0", "--train.seq_len", "16", "--train.micro_batch_size", "2"]


@pytest.mark.parametrize("argv, option", [
    (["train", *ONE_STEP, "--run-dir", ""], "--run-dir"),
    (["train", "--resume", ""], "--resume"),
    (["train", "--init-from-hf", ""], "--init-from-hf"),
    (["generate", "--run-dir", "", "--prompt", "x"], "--run-dir"),
    (["convert", "--from-hf", "", "--out", "r"], "--from-hf"),
    (["convert", "--from-hf", "h", "--out", ""], "--out"),
    (["convert", "--run-dir", "", "--to-hf", "h"], "--run-dir"),
    (["convert", "--run-dir", "r", "--to-hf", ""], "--to-hf"),
    (["bench", "--json", ""], "--json"),
    (["bench", "--profile", ""], "--profile"),
])
def test_an_empty_path_is_refused_not_taken_as_the_current_directory(tmp_path, monkeypatch, capsys, argv, option):
    """Path('') is '.': `train --run-dir ""` (an unset shell variable) trained into the current
    directory and `convert --to-hf ""` wrote the checkpoint there, without a word."""
    monkeypatch.chdir(tmp_path)
    line = _one_error_line(capsys, argv)
    assert line.startswith(f"moefold: error: argument {option}: an empty path; give a directory or file (see ")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [["config", "show"], ["plan", "memory"], ["train", *ONE_STEP]])
def test_an_empty_config_name_is_refused_not_taken_as_the_default_preset(tmp_path, monkeypatch, capsys, command):
    monkeypatch.chdir(tmp_path)
    line = _one_error_line(capsys, [*command, "--config", ""])
    assert line.startswith("moefold: error: argument --config: an empty name; give a preset (")
