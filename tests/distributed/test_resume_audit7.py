"""A run on two gloo ranks that crashes after a checkpoint, resumed in one process, against one
uninterrupted process: the records of metrics.jsonl, the expert-load history and the final
weights and optimizer states."""

from pathlib import Path

import pytest
import torch
from conftest import metrics_records, write_text_corpus
from ranks import run_ranks

from moefold.config import load_config
from moefold.train.trainer import Trainer

# Log every 4, save every 3 (step 6 inside the log window 5–8), 2 micro-batches a step; a global
# micro-batch of 4 sequences and 4 validation sequences on either layout.
RUN = {"train.seq_len": "16", "train.steps": "8", "train.warmup_steps": "2", "train.grad_accum": "2",
       "train.val_every": "4", "data.val_fraction": "0.1", "train.device": "cpu",
       "logging.tensorboard": "false", "logging.progress_bar": "false", "logging.expert_load_heatmap": "false",
       "logging.log_every": "4", "checkpoint.every": "3", "moe.aux_loss_coeff": "0.01"}
LAYOUTS = {"fsdp": {}, "ep2": {"parallel.ep": "2"}}


def _config(corpus: Path, dp: int, **parallel: str):
    """The same global batch and validation sequences on `dp` data ranks."""
    return load_config("tiny-qwen3", {**RUN, "data.path": str(corpus), "train.micro_batch_size": str(4 // dp),
                                      "train.val_batches": str(dp), **parallel})


class _Crash(Exception):
    pass


def _crash_in_step_7(rank: int, corpus: Path, run: Path, parallel: dict[str, str]) -> None:
    train_step = Trainer.train_step

    def crashing(self):
        if self.step == 6:
            raise _Crash()
        return train_step(self)

    Trainer.train_step = crashing
    with pytest.raises(_Crash):
        Trainer(_config(corpus, 2, **parallel), run, out=lambda line: None).fit()


def _states(trainer: Trainer) -> dict[str, torch.Tensor]:
    state = trainer._state()
    return {f"{part}.{name}": value for part in ("model", "optim") for name, value in _flat(state[part]).items()}


def _flat(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): tree}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_crash_on_two_ranks_resumes_in_one_process_as_the_uninterrupted_run(layout, tmp_path):
    """FSDP or ep2 on two ranks, crashed in step 7 after the checkpoint of step 6, resumed in one
    process: every record (training and validation), the heatmap's windows and the final states
    are the uninterrupted process's (the step-8 record averaged steps 7–8 before a checkpoint
    ended the log window)."""
    corpus = write_text_corpus(tmp_path / "corpus")
    whole = Trainer(_config(corpus, 1), tmp_path / "whole", out=lambda line: None)
    whole.fit()
    run = tmp_path / "run"
    run_ranks(2, _crash_in_step_7, corpus, run, LAYOUTS[layout])
    resumed = Trainer(_config(corpus, 1), run, resume=run, out=lambda line: None)
    resumed.fit()

    got, want = metrics_records(run), metrics_records(tmp_path / "whole")
    assert [(r["step"], sorted(r)) for r in got] == [(r["step"], sorted(r)) for r in want]
    for g, w in zip(got, want):
        for key, value in w.items():
            assert g[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (w["step"], key)
    assert [step for step, _ in resumed.load_history] == [step for step, _ in whole.load_history]
    assert [counts for _, counts in resumed.load_history] == [counts for _, counts in whole.load_history]
    got_states, want_states = _states(resumed), _states(whole)
    assert got_states.keys() == want_states.keys()
    for name, value in want_states.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(got_states[name], value, rtol=1e-4, atol=1e-5, msg=name)
