"""Audit 9 of the memory planner (plan/*): each check against an independent reference, not the
planner's own formulas: a real training micro-batch under FakeTensorMode with every storage followed
from allocation to release (plan.peaks)."""

import pytest

from moefold.config import load_config
from moefold.plan import predict_memory
from moefold.plan.peaks import measure_peaks

# Two Qwen3-30B-A3B layers with a small vocabulary, so that a layer, not the loss, sets the peaks.
QWEN3_LAYERS = {"model.n_layers": 2, "train.micro_batch_size": 2, "train.seq_len": 2048,
                "model.vocab_size": 4096}


# A recomputed (or offloaded) block keeps little for backward, but while its forward runs it makes
# every tensor the plain block would keep: under fp32 parameters the experts' bf16 weight casts and
# their [R, F] rows, freed only as the block returns. The plan's forward ended with the kept bytes
# and the loss's workspace, and put the forward peak 5.4% (recompute ["layer"], 845 MiB) and 4.3%
# (["moe"]) below the tracked run's.
@pytest.mark.parametrize("names", ['["layer"]', '["moe"]'])
def test_forward_peak_holds_a_recomputed_block_s_own_tensors_while_it_runs(names):
    cfg = load_config("qwen3-30b-a3b", {**QWEN3_LAYERS, "memory.recompute": names})
    measured, plan = measure_peaks(cfg, "fp32"), predict_memory(cfg, 1)
    assert plan.phase_peak("forward") == pytest.approx(measured.forward, rel=0.05)
    assert plan.phase_peak("forward") >= measured.forward
