"""`generate` and `convert --to-hf` take the path forms `train --resume` takes: a run (its latest
checkpoint), its checkpoints folder (the latest too) or one of its checkpoints, `RUN/checkpoints/
step_N`, read with the config that checkpoint was saved with. The references are independent of
the command's path handling: a model built from the options the run trained with and loaded with
`load_weights` straight from the checkpoint, and the export of a copy of the run whose latest
checkpoint is the one named."""

import shutil
from pathlib import Path

import pytest
import torch

STEP2, STEP4 = "step_00000002", "step_00000004"
PROMPT = "document 3: w"
GREEDY = ["--prompt", PROMPT, "--max-new-tokens", "24", "--temperature", "0", "--device", "cpu"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from conftest import write_text_corpus

    return write_text_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def branched_run(tmp_path_factory, corpus) -> Path:
    """Checkpoint step 2 of moe.top_k 2, then step 4 of a `--resume --moe.top_k 3`, which its
    config.toml holds: step 2's model is one config.toml no longer describes."""
    from conftest import TINY_OVERRIDES, cli_args

    from moefold.cli import main

    run = tmp_path_factory.mktemp("branched") / "run"
    args = cli_args({**TINY_OVERRIDES, "data.path": str(corpus), "train.steps": "2", "train.warmup_steps": "1"})
    assert main(["train", "--run-dir", str(run), *args]) == 0
    assert main(["train", "--resume", str(run), "--train.steps", "4", "--moe.top_k", "3"]) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [STEP2, STEP4]
    return run


def _reference_model(corpus: Path, checkpoint: Path, top_k: int):
    """The model `checkpoint` holds, built from the options given here (not read back from the
    run) and its weights loaded directly; dropless, as generate builds it."""
    from conftest import TINY_OVERRIDES

    from moefold.checkpoint.dcp import load_weights
    from moefold.config import load_config
    from moefold.models.transformer import build_model

    cfg = load_config(None, {**TINY_OVERRIDES, "data.path": str(corpus), "moe.top_k": str(top_k),
                             "moe.capacity_factor": "0"})
    model = build_model(cfg, 257)
    load_weights(model, checkpoint)
    return model.eval()


def _greedy_text(model) -> str:
    from moefold.data.tokenizer import build_tokenizer
    from moefold.generate import continuation, sample

    tokenizer = build_tokenizer("")
    prompt_ids = tokenizer.encode_prompt(PROMPT)
    new_ids = sample(model, prompt_ids, 24, 0.0, 0, 32, tokenizer.eos_id, torch.Generator(), 257)
    return continuation(tokenizer, PROMPT, prompt_ids, new_ids)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([list(PROMPT.encode())])).float()


def _generate(run_dir: Path, capsys, sampled_models) -> tuple[str, str, object]:
    """(stdout, stderr, the model sampled) of `generate --run-dir run_dir`, greedy."""
    from moefold.cli import main

    sampled_models.clear()  # this command's models only
    capsys.readouterr()
    assert main(["generate", "--run-dir", str(run_dir), *GREEDY]) == 0
    captured = capsys.readouterr()
    [model] = sampled_models
    return captured.out, captured.err, model


def test_generate_from_an_earlier_checkpoint_samples_that_checkpoint(branched_run, corpus, capsys, sampled_models):
    """`generate --run-dir RUN/checkpoints/step_N` was refused (it would have sampled the latest).
    It samples step N, with the config step N was saved with (top_k 2; config.toml says 3): the
    text and logits of a top_k-2 model loaded straight from step 2, not the latest's; no note
    (config.toml's top_k 3 is a later start's that did save, step 4)."""
    reference = _reference_model(corpus, branched_run / "checkpoints" / STEP2, top_k=2)
    out, err, model = _generate(branched_run / "checkpoints" / STEP2, capsys, sampled_models)
    assert model.cfg.moe.top_k == 2
    assert torch.equal(_logits(model), _logits(reference))
    assert out == _greedy_text(reference) + "\n"
    assert err == ""
    latest_out, _, latest_model = _generate(branched_run, capsys, sampled_models)
    assert latest_model.cfg.moe.top_k == 3
    assert not torch.allclose(_logits(latest_model), _logits(reference))
    assert latest_out != out


def test_generate_from_the_latest_checkpoint_or_the_checkpoints_folder_equals_the_run(branched_run, corpus, capsys,
                                                                                      sampled_models):
    """RUN, RUN/checkpoints and RUN/checkpoints/step_<latest> sample the same model, as `--resume`
    reads all three as the latest checkpoint: a top_k-3 model loaded straight from step 4."""
    reference = _reference_model(corpus, branched_run / "checkpoints" / STEP4, top_k=3)
    expected = _greedy_text(reference) + "\n"
    for given in (branched_run, branched_run / "checkpoints", branched_run / "checkpoints" / STEP4):
        out, err, model = _generate(given, capsys, sampled_models)
        assert (out, err) == (expected, ""), given
        assert torch.equal(_logits(model), _logits(reference)), given


def test_generate_from_a_checkpoint_without_its_config_takes_config_toml_and_says_so(branched_run, corpus, capsys,
                                                                                    monkeypatch, sampled_models):
    """A checkpoint that holds no config (weights only, or saved by an earlier moefold) takes the
    run's config.toml (top_k 3 here), as `--resume` of it does, with the same note where it is
    not the run's latest."""
    import moefold.checkpoint.run_config as run_config

    step2 = branched_run / "checkpoints" / STEP2
    monkeypatch.setattr(run_config, "CONFIG_KEY", "not_the_config")  # read as holding none
    reference = _reference_model(corpus, step2, top_k=3)
    out, err, model = _generate(step2, capsys, sampled_models)
    assert torch.equal(_logits(model), _logits(reference))
    assert out == _greedy_text(reference) + "\n"
    assert err.splitlines() == [
        f"note: --run-dir {step2} holds no config of its own (weights only, or saved by an earlier moefold): its "
        f"model is built with {branched_run / 'config.toml'}, the options of the run's latest start, which may "
        "differ from those it was saved with"]


def _hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {name: tensor for file in sorted(hf_dir.glob("*.safetensors")) for name, tensor in load_file(file).items()}


def test_convert_to_hf_of_an_earlier_checkpoint_exports_its_weights(branched_run, corpus, tmp_path):
    """`convert --run-dir RUN/checkpoints/step_N --to-hf DIR` exports step N: every tensor equal to
    the export of a copy of the run whose latest checkpoint is step N, its embedding equal to the
    one loaded straight from step N, config.json stating its top_k 2, and not the latest's."""
    import json

    from moefold.cli import main

    copy = tmp_path / "copy"
    shutil.copytree(branched_run, copy)
    shutil.rmtree(copy / "checkpoints" / STEP4)  # step 2 is its latest
    for source, out in ((branched_run / "checkpoints" / STEP2, "hf"), (copy, "hf-copy"),
                        (branched_run, "hf-latest")):
        assert main(["convert", "--run-dir", str(source), "--to-hf", str(tmp_path / out)]) == 0
    exported, of_copy, latest = (_hf_tensors(tmp_path / out) for out in ("hf", "hf-copy", "hf-latest"))
    assert exported.keys() == of_copy.keys() == latest.keys()
    for name in exported:
        assert torch.equal(exported[name], of_copy[name]), name
    reference = _reference_model(corpus, branched_run / "checkpoints" / STEP2, top_k=2)
    assert torch.equal(exported["model.embed_tokens.weight"], reference.tok_embeddings.weight.detach())
    assert not torch.equal(exported["model.embed_tokens.weight"], latest["model.embed_tokens.weight"])
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_experts_per_tok"] == 2


def _error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line]


def _command_args(command: str, tmp_path: Path) -> list[str]:
    return GREEDY if command == "generate" else ["--to-hf", str(tmp_path / "hf")]


@pytest.mark.parametrize("command", ["generate", "convert"])
@pytest.mark.parametrize("name", ["step_00000004.tmp", "step_00000002.old", "latest"])
def test_a_leftover_of_the_checkpoints_folder_is_refused_as_resume_refuses_it(branched_run, tmp_path, capsys,
                                                                              command, name):
    """A save's `.tmp` or a removal's `.old` (or another name) under RUN/checkpoints: the line
    `--resume` gives, naming --run-dir, exit 2, nothing written."""
    from moefold.cli import main

    leftover = branched_run / "checkpoints" / name
    shutil.copytree(branched_run / "checkpoints" / STEP2, leftover)
    (leftover / ".metadata").unlink()  # DCP writes it last: a save killed half-way has none
    try:
        capsys.readouterr()
        assert main(["train", "--resume", str(leftover), "--train.steps", "6"]) == 2
        [resume_line] = _error_lines(capsys)
        assert "not a complete checkpoint" in resume_line
        assert main([command, "--run-dir", str(leftover), *_command_args(command, tmp_path)]) == 2
        assert _error_lines(capsys) == [resume_line.replace(f"--resume {leftover}", f"--run-dir {leftover}")]
    finally:
        shutil.rmtree(leftover)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("command", ["generate", "convert", "train"])
def test_a_step_the_run_does_not_hold_is_named_with_those_it_does(branched_run, tmp_path, capsys, command):
    """`RUN/checkpoints/step_N` that does not exist (rotated out, mistyped) said 'no such directory'
    (to --resume; generate and convert refused any checkpoint): one line naming it and the run's
    checkpoints, exit 2."""
    from moefold.cli import main

    missing = branched_run / "checkpoints" / "step_00000003"
    option = "--resume" if command == "train" else "--run-dir"
    rest = ["--train.steps", "6"] if command == "train" else _command_args(command, tmp_path)
    capsys.readouterr()
    assert main([command, option, str(missing), *rest]) == 2
    assert _error_lines(capsys) == [f"moefold: error: {option} {missing}: no such checkpoint; the run's complete "
                                    f"checkpoints are {STEP2}, {STEP4} (in {branched_run / 'checkpoints'})"]
    assert not (tmp_path / "hf").exists()
    assert sorted(p.name for p in (branched_run / "checkpoints").iterdir()) == [STEP2, STEP4]


def test_a_checkpoint_outside_a_run_is_named_with_the_directory_that_is_no_run(branched_run, tmp_path, capsys):
    """A checkpoint copied out of its run (no config.toml two levels up): its data.path and
    data.tokenizer come from config.toml, so it is refused, naming the directory that lacks one."""
    from moefold.cli import main

    alone = tmp_path / "elsewhere" / "checkpoints" / STEP2
    shutil.copytree(branched_run / "checkpoints" / STEP2, alone)
    capsys.readouterr()
    assert main(["generate", "--run-dir", str(alone), *GREEDY]) == 2
    assert _error_lines(capsys) == [f"moefold: error: --run-dir {alone}: its run directory {tmp_path / 'elsewhere'} "
                                    "holds no config.toml (not a moefold run directory)"]
