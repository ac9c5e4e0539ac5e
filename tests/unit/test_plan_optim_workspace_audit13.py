"""The plan's optimizer workspace (`optimizer_step`) is what rank 0's fp8-moment step allocates.

With fp8 moments the GPU updates every piece that holds its fp8 blocks whole with the Triton kernel
(no temporaries) and the others on PrecisionAwareAdamW's foreach path, a chunk of up to
FOREACH_ELEMENTS at a time (optim/precision.py `step`): pieces whose last dimension is cut inside a
block (TP's row-parallel weights and ETP's w1/w3 where width / ranks is no multiple of 128, 1-D
weights cut by the data ranks). That path's fp32 copies and the blocks' padded working buffers
(optim/blocks.py pads each row's piece to whole 128-element blocks) are the workspace. The plan
counted 20 bytes per element of the model's largest tensor over the data ranks, not over tp, and
as the ranks' mean share.

Reference: the foreach path of the GPU's step, run on gloo ranks on the CPU over the pieces the
GPU leaves it, under a dispatch mode that counts every storage the step allocates while it lives
(`_PeakBytes`); rank 0's peak against the plan, to the byte."""

import weakref

import torch
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

from moefold.config import load_config

FP8_MOMENTS = {"optim.exp_avg_dtype": "fp8", "optim.exp_avg_sq_dtype": "fp8",
               "train.micro_batch_size": "1", "train.seq_len": "16"}
CASES = {  # name: (world, preset, overrides)
    # wo's 64 columns cut in two: 32 of a 128-wide block on each rank
    "tp 2, fp32": (2, "tiny-qwen3", {"parallel.tp": "2"}),
    # and the experts' w1/w3 32 columns cut in two by ETP; bf16 masters, one fp8 moment
    "tp 2, etp 2, bf16": (2, "tiny-qwen3", {"parallel.tp": "2", "parallel.etp": "2",
                                            "optim.master_dtype": "bf16", "optim.exp_avg_sq_dtype": "fp32"}),
    # ZeRO-1 cuts the 257-row embedding's 64 columns (no leading dim splits evenly): 32 a rank
    "ddp (ZeRO-1)": (2, "tiny-qwen3", {"parallel.data_parallel": "ddp"}),
    # the same over 3 data ranks: 22, 22, 20 of wo's 64 rows, norm weights cut 22/22/20
    "tp 2 x dp 3, bf16+remainder": (6, "tiny-qwen3", {"parallel.tp": "2",
                                                     "optim.master_dtype": "bf16+remainder"}),
    # 3 data ranks only: the norm weights' 64 columns cut 22/22/20; one fp8 moment
    "dp 3, fp8 second moment": (3, "tiny-qwen3", {"optim.exp_avg_dtype": "bf16"}),
}


class _PeakBytes(TorchDispatchMode):
    """The most bytes of storages allocated under the mode alive at once (views and in-place
    results share their input's storage: not counted again; storages from before: not counted)."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.seen = 0, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if key in self.seen or key in inputs or nbytes == 0:
                continue
            self.seen.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, nbytes)
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self.seen.discard(key)


def _foreach_peak(optimizer) -> int:
    """The GPU step's foreach part (PrecisionAwareAdamW.step with fused groups on CUDA: pieces that
    do not hold their fp8 blocks whole, in `_chunks`), each chunk's peak; the most of them."""
    from moefold.optim.precision import FOREACH_ELEMENTS, _chunks

    peaks = [0]
    for group in optimizer.param_groups:
        cut = [p for p in group["params"] if p.grad is not None and not optimizer._whole_blocks(p)]
        for chunk in _chunks(cut, FOREACH_ELEMENTS):
            with _PeakBytes() as mode:
                optimizer._step_group(chunk, group)
            peaks.append(mode.peak)
    return max(peaks)


def _planned_and_measured(rank: int, run_dir: str, world: int) -> dict:
    from moefold.plan import predict_memory
    from moefold.train.trainer import Trainer

    out = {}
    for i, (name, (_, preset, overrides)) in enumerate(CASES.items()):
        if CASES[name][0] != world:
            continue
        cfg = load_config(preset, {**FP8_MOMENTS, **overrides})
        trainer = Trainer(cfg, f"{run_dir}/{i}-{rank}", out=lambda line: None)
        trainer.accumulate_gradients()
        planned = predict_memory(cfg, world, vocab_size=trainer.vocab_size).optimizer_step
        out[name] = (planned, _foreach_peak(trainer.optimizer))
    return out


def _check(world: int, tmp_path) -> None:
    from test_parallel_dims import results_on_ranks

    tmp_path.mkdir(exist_ok=True)
    ranks = results_on_ranks(_planned_and_measured, world, tmp_path, str(tmp_path), world)
    for name in ranks[0]:
        planned, real = ranks[0][name][0], [r[name][1] for r in ranks]
        assert real[0] > 0, name
        assert planned == real[0] == max(real), (name, planned, real)


def test_tp_2_workspace_is_rank_0_s_peak(tmp_path):
    """Before: 328,960 B planned (20 B of the 257 x 64 embedding, which has no cut blocks) where
    the step allocates 361,984 B (two 64 x 32 wo pieces: each row padded to a 128-wide block)."""
    _check(2, tmp_path)


def test_uneven_rows_over_3_data_ranks_workspace_is_rank_0_s_peak(tmp_path):
    """Before: 109,653.33 B planned (a mean share), rank 0 allocating 124,432 B in fp32 (22 of
    wo's 64 rows); with the norm weights alone (dp 3) 0 planned, 24,220 B real."""
    _check(6, tmp_path)
    _check(3, tmp_path / "dp3")
