"""The refusal of a model that cannot fit (plan/fit.py) on a GPU: the floor against what a CUDA
step holds (fp32 parameters under bf16 autocast; the lean optimizer's bf16 parameters, remainders
and Triton update), and the GPU's own memory as the capacity."""

import pytest
import torch

from moefold.cli import main
from moefold.plan.fit import rank_capacity
from conftest import TINY_OVERRIDES, floor_and_held_after_a_step

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.mark.parametrize("optim", [
    {},
    {"optim.master_dtype": "bf16+remainder", "optim.grad_dtype": "bf16"},
    {"optim.master_dtype": "fp32", "precision.compute_dtype": "fp32"},
])
def test_the_floor_is_what_one_gpu_holds_after_a_step(tmp_path, text_corpus, optim):
    floor, held = floor_and_held_after_a_step(tmp_path / "run", {
        **TINY_OVERRIDES, "data.path": str(text_corpus), "train.device": "cuda", "model.dim": "128",
        "moe.expert_hidden": "128", "model.ffn_hidden": "256", **optim})
    assert 0.9 * held <= floor <= held, (floor, held)


def test_a_model_beyond_the_gpu_is_refused_before_it_is_built(tmp_path, tiny_args, capsys):
    capacity = rank_capacity(torch.device("cuda"), ranks_on_host=8)
    assert capacity.ranks == 1 and capacity.bytes == torch.cuda.get_device_properties(0).total_memory
    run = tmp_path / "run"
    capsys.readouterr()
    argv = ["train", "--run-dir", str(run), *tiny_args, "--train.device", "cuda", "--model.n_layers", str(10**6)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the GPU has" in err, err
    assert not run.exists()
