"""`moefold train --nproc N` at its edges (parallel/launch.py): what the launcher refuses before it
starts a rank."""

from unittest import mock

import pytest

from moefold.cli import main
from moefold.parallel import launch
from moefold.plan import fit


@pytest.mark.parametrize("gpus, visible", [(2, "2 GPUs are"), (1, "1 GPU is")])
def test_more_ranks_than_gpus_is_one_line_before_any_rank_starts(tmp_path, tiny_args, capsys, gpus, visible):
    """--nproc 3 where 2 GPUs are visible (here: CUDA made to look so): the ranks started, and
    those past the last GPU each failed alone, 'LOCAL_RANK=2 but only 2 GPUs are visible' (one
    line per extra rank, none naming --nproc), after every rank's start-up. The launcher refuses it
    in one line naming --nproc, exit 2, no rank started and nothing written."""
    run = tmp_path / "run"
    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.device_count", return_value=gpus), \
            mock.patch.object(fit, "rank_capacity", return_value=None), \
            mock.patch.object(launch, "spawn_local", return_value=0) as spawn:
        capsys.readouterr()
        code = main(["train", *tiny_args, "--train.device", "cuda", "--nproc", "3", "--run-dir", str(run)])
    spawn.assert_not_called()
    assert (code, capsys.readouterr().err.splitlines()) == (2, [
        f"moefold: error: --nproc 3: only {visible} visible; start at most one rank per GPU "
        "(train.device='cpu' runs the ranks on the CPU with gloo)"])
    assert not run.exists()
