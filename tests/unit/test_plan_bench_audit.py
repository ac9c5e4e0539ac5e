"""`moefold plan memory` and `moefold bench` against independent references: the plan refuses the
configs training refuses, in training's words; its parameter and FLOP counts equal counts over the
real built model and FLOP formulas written out per layer; its weight, gradient and optimizer-state
bytes equal the real tensors' sizes on the CPU."""

import pytest

from moefold.cli import main
from moefold.config import load_config
from moefold.errors import UserError
from moefold.train.trainer import Trainer


def _one_line_error(capsys, argv: list[str]) -> str:
    """The line `moefold ARGV` ends with; asserts exit 2 and nothing more on stderr."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.removeprefix("moefold: error: ").rstrip("\n")


def _training_error(overrides: dict[str, str], run_dir) -> str:
    with pytest.raises(UserError) as refused:
        Trainer(load_config("tiny", overrides), run_dir, out=lambda line: None)
    return str(refused.value)


# Configs whose validation passes but which training refuses once it builds the model or reads
# the tokenizer (bf16 compute, as the plan assumes for a GPU).
REFUSED_BY_TRAINING = {
    "fp8_exclude matching no module": {"precision.fp8": "tensorwise", "precision.fp8_exclude": '["nomatch"]'},
    "fp8 experts unaligned": {"precision.fp8": "blockwise", "moe.expert_hidden": "200"},
    "fp8 experts unaligned for tensorwise": {"precision.fp8": "tensorwise", "moe.expert_hidden": "72"},
    "grouped_mm experts unaligned": {"moe.experts_backend": "grouped_mm", "moe.expert_hidden": "100"},
    "vocabulary below the tokenizer's": {"model.vocab_size": "100"},
}


@pytest.mark.parametrize("name", list(REFUSED_BY_TRAINING))
def test_plan_refuses_what_training_refuses_with_its_message(capsys, tmp_path, name):
    """The plan accepted each of these and printed a prediction for a run that cannot start."""
    overrides = {**REFUSED_BY_TRAINING[name], "precision.compute_dtype": "bf16"}
    expected = _training_error(overrides, tmp_path / "run")
    argv = [arg for key, value in overrides.items() for arg in (f"--{key}", value)]
    assert _one_line_error(capsys, ["plan", "memory", "--config", "tiny", *argv]) == expected


def test_plan_refuses_the_fp8_weight_cache_where_fsdp_shards_the_experts(capsys):
    """Training refuses precision.fp8_weight_cache under FSDP with edp > 1 (Trainer); the plan
    printed the cache's bytes for it. With ddp, or edp 1, the plan still answers."""
    cache = ["plan", "memory", "--config", "tiny", "--precision.fp8", "tensorwise",
             "--precision.fp8_weight_cache", "true"]
    assert _one_line_error(capsys, [*cache, "--gpus", "2"]) == (
        "precision.fp8_weight_cache=true needs the experts' weights whole on each rank; "
        "parallel.data_parallel=fsdp shards them over edp=2: use parallel.data_parallel=ddp, or set "
        "precision.fp8_weight_cache=false")
    assert main([*cache, "--gpus", "2", "--parallel.data_parallel", "ddp"]) == 0
    assert main([*cache, "--gpus", "2", "--parallel.ep", "2"]) == 0

