"""No host sync in a training step between log steps (docs/performance.md, "Host syncs").

On a GPU, reading a device value on the host (`.item()`, `bool(t)`, `.tolist()`, a boolean mask, a
blocking copy to or from the host — `torch.tensor(data, device=cuda)` included, which copies from
pageable memory and waits for the stream) stalls the CPU until the GPU catches up. Here, on the CPU,
`HostReads` records every such operation made by whole `Trainer` steps (after the first, as the
style guide's `set_sync_debug_mode` turns on after it) outside the log step's work, with the code
site that made it; each site is either a value that lives on the host on any device by design
(`CPU_BY_DESIGN`, each with its reason), a deliberate sync marked "HOST SYNC" in the source
(`DELIBERATE`), or a defect. Layouts of several ranks run on gloo (tests/ranks.py).
"""

import contextlib
import dataclasses
import functools
import traceback
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import TINY_OVERRIDES, write_text_corpus
from ranks import run_ranks

from moefold.config import load_config
from moefold.train.trainer import Trainer

aten = torch.ops.aten
# Ops that read a device value on the host, or copy host data to the device (lift_fresh: torch.tensor
# of Python data, which on a GPU is a blocking copy from pageable memory).
HOST_READ_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
                 aten.is_nonzero.default, aten.equal.default, aten._unique2.default, aten.unique_dim.default,
                 aten.unique_consecutive.default, aten.repeat_interleave.Tensor, aten.index.Tensor,
                 aten.index_put_.default, aten._index_put_impl_.default, aten.lift_fresh.default}

CPU_BY_DESIGN = {
    # The loader builds each batch on the host (int64 CPU tensors; moved with non_blocking=True).
    ("loader.py", "next_batch"), ("loader.py", "check"), ("loader.py", "gather"),
    ("loader.py", "document_ids"),
    # torch's foreach AdamW (the CPU's choice; the GPU's is fused) keeps its step counts on the CPU.
    ("optimizer.py", "_get_value"), ("adam.py", "_multi_tensor_adam"),
    # PrecisionAwareAdamW's step counts are CPU tensors on any device (optim/precision.py).
    ("precision.py", "_step_group"), ("precision.py", "_step_param"), ("precision.py", "_step_fused"),
    # Several ranks vote on a stop signal over a gloo group of their own, with a CPU flag (train/stop.py).
    ("stop.py", "agreed"), ("stop.py", "_wait"), ("stop.py", "settled"),
    # ... and on no bad token id in any data rank's rows, with a CPU flag too (train/step_data.py).
    ("step_data.py", "_start_vote"), ("step_data.py", "_raise_first_failure"),
}
DELIBERATE = {
    ("expert.py", "tolist"),  # HOST SYNC: NCCL's all-to-all needs split sizes on the host
}
LOG_WORK = ("_close_window", "_log_validation", "_save_if_due", "_save_after_records", "_write_end_of_run")
"""The loop's methods that run at log, validation and checkpoint steps only: their reads are allowed."""


@dataclasses.dataclass(frozen=True)
class Read:
    op: str
    file: str
    function: str
    line: int

    @property
    def site(self) -> tuple[str, str]:
        return self.file, self.function


def _call_site(op: str) -> Read:
    """The innermost frame in moefold or torch.optim: the code that asked for the read."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = Path(frame.filename)
        if frame.name.startswith("<") and frame.name != "<module>":  # a comprehension: its function's
            continue
        if "moefold" in path.parts or ("torch" in path.parts and "optim" in path.parts):
            return Read(op, path.name, frame.name, frame.lineno)
    return Read(op, "?", "?", 0)


class HostReads(TorchDispatchMode):
    """Records the host reads made while `active`, with their call sites."""

    def __init__(self):
        super().__init__()
        self.active, self.reads = False, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.active and func in HOST_READ_OPS and _reads_host(func, args, kwargs):
            self.record(str(func))
        return func(*args, **kwargs)

    def record(self, op: str) -> None:
        self.reads.append(_call_site(op))

    @contextlib.contextmanager
    def paused(self):
        was, self.active = self.active, False
        try:
            yield
        finally:
            self.active = was


def _reads_host(func, args, kwargs) -> bool:
    if func in (aten.index.Tensor, aten.index_put_.default, aten._index_put_impl_.default):
        return any(i is not None and i.dtype == torch.bool for i in args[1])  # a mask: data-dependent shape
    if func is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    return True


@contextlib.contextmanager
def recording(monkeypatch):
    """A `HostReads` in force, with the Tensor methods that read a CPU tensor without dispatching
    (tolist, numpy, cpu, a blocking .to(device)) recorded too."""
    reads = HostReads()
    for name in ("tolist", "numpy", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, _recorded(getattr(torch.Tensor, name), reads, f"Tensor.{name}"))
    to = torch.Tensor.to

    def recorded_to(self, *args, **kwargs):
        moves = any(isinstance(a, (str, torch.device)) for a in (*args, kwargs.get("device")))
        if reads.active and moves and not kwargs.get("non_blocking"):
            reads.record("Tensor.to(device)")
        return to(self, *args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "to", recorded_to)
    with reads:
        yield reads


def _recorded(method, reads: HostReads, op: str):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if reads.active:
            reads.record(op)
        return method(self, *args, **kwargs)
    return wrapper


def train_between_log_steps(trainer: Trainer, reads: HostReads) -> None:
    """`trainer.fit()` with `reads` active from the second step on, paused in the log step's work."""
    step = trainer.train_step

    def recorded_step():
        reads.active = trainer.step >= 1
        return step()
    trainer.train_step = recorded_step
    for name in LOG_WORK:
        method = getattr(trainer, name)
        setattr(trainer, name, _paused(method, reads))
    trainer.fit()


def _paused(method, reads: HostReads):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with reads.paused():
            return method(*args, **kwargs)
    return wrapper


def unexpected(reads: list[Read]) -> list[Read]:
    return sorted({r for r in reads if r.site not in CPU_BY_DESIGN | DELIBERATE}, key=str)


def tiny_config(corpus: Path, preset: str | None = None, **overrides):
    """Three steps, logged at the last only; no validation, no checkpoint."""
    return load_config(preset, {**TINY_OVERRIDES, "data.path": str(corpus), "train.steps": "3",
                                "logging.log_every": "3", "checkpoint.save_at_end": "false",
                                **{k.replace("__", "."): v for k, v in overrides.items()}})


DEEPSEEK = dict(model__n_layers="2", moe__num_experts="8", model__n_kv_heads="0")
ALL_AUX = dict(moe__score_func="sigmoid", moe__expert_bias="true", moe__global_aux_loss_coeff="0.01",
               moe__seq_aux_loss_coeff="0.01", moe__z_loss_coeff="0.001", moe__shared_experts="1",
               moe__input_jitter="0.01", moe__capacity_factor="1.0")
CASES = {
    "accum2-every-aux-loss-bias-capacity": (None, dict(train__grad_accum="2", **ALL_AUX)),
    "deepseek-mtp-groups-chunked-loss": ("tiny-deepseek", dict(train__loss_chunk_tokens="16", **DEEPSEEK)),
    "mixtral-accum2": ("tiny-mixtral", dict(train__grad_accum="2", model__n_layers="2")),
    "fp8-moments-remainder-bf16-grads": (None, dict(optim__exp_avg_dtype="fp8", optim__exp_avg_sq_dtype="bf16",
                                                    optim__master_dtype="bf16+remainder", optim__grad_dtype="bf16")),
    "bf16-master-no-clip": (None, dict(optim__exp_avg_dtype="bf16", optim__exp_avg_sq_dtype="fp8",
                                       optim__master_dtype="bf16", train__grad_clip="0")),
    "recompute-padded-bf16": (None, dict(memory__recompute='["norm", "attn_core", "moe", "mlp"]',
                                         moe__pad_multiple="8", precision__compute_dtype="bf16")),
    "fp8-emulated-weight-cache": (None, dict(precision__fp8="tensorwise", precision__fp8_emulate="true",
                                             precision__fp8_weight_cache="true", train__grad_accum="2")),
}


@pytest.mark.parametrize("preset, overrides", CASES.values(), ids=CASES.keys())
def test_steps_between_log_steps_read_nothing_from_the_device(tmp_path, monkeypatch, preset, overrides):
    trainer = Trainer(tiny_config(write_text_corpus(tmp_path / "corpus"), preset, **overrides), tmp_path / "run",
                      out=lambda line: None)
    with recording(monkeypatch) as reads:
        train_between_log_steps(trainer, reads)
    assert reads.reads, "nothing recorded: the harness is blind"  # the loader's host reads at least
    assert unexpected(reads.reads) == []


def test_gpu_optimizer_choice_reads_nothing_from_the_device(tmp_path, monkeypatch):
    """torch's fused AdamW with the clip coefficient as its grad_scale, as the trainer builds it on
    a GPU (fused AdamW runs on the CPU too)."""
    from moefold.optim.adamw import ClipInFusedAdamW, build_optimizer, clip_scaling
    from moefold.optim.schedule import build_scheduler
    from moefold.parallel.data import GradNormClipper

    cfg = tiny_config(write_text_corpus(tmp_path / "corpus"), train__grad_accum="2")
    trainer = Trainer(cfg, tmp_path / "run", out=lambda line: None)
    trainer.optimizer = build_optimizer(trainer.model, cfg.train, torch.device("cuda"), cfg.optim)
    trainer.clip_gradients = GradNormClipper(list(trainer.model.parameters()), None,
                                             clip_scaling(trainer.optimizer, cfg.optim))
    trainer.scheduler = build_scheduler(trainer.optimizer, cfg.train)
    assert isinstance(trainer.clip_gradients.scale, ClipInFusedAdamW)
    with recording(monkeypatch) as reads:
        train_between_log_steps(trainer, reads)
    assert unexpected(reads.reads) == []


def test_the_harness_sees_the_log_steps_read(tmp_path, monkeypatch):
    """Not paused there, the log step's deliberate read (trainer.py's HOST SYNC) is recorded."""
    trainer = Trainer(tiny_config(write_text_corpus(tmp_path / "corpus")), tmp_path / "run", out=lambda line: None)
    with recording(monkeypatch) as reads:
        step = trainer.train_step

        def recorded_step():
            reads.active = True
            return step()
        trainer.train_step = recorded_step
        trainer.fit()
    assert {"_log_window", "_to_host"} <= {r.function for r in unexpected(reads.reads)}


def test_the_harness_records_each_kind_of_read(monkeypatch):
    x = torch.arange(4.0)
    with recording(monkeypatch) as reads:
        reads.active = True
        x.sum().item(), bool(x[0]), x.tolist(), x[x > 1], torch.tensor([1.0, 2.0]), x.to("cpu")
    assert [r.op for r in reads.reads] == ["aten._local_scalar_dense.default", "aten._local_scalar_dense.default",
                                           "Tensor.tolist", "aten.index.Tensor", "aten.lift_fresh.default",
                                           "Tensor.to(device)"]


def test_grad_norm_follows_the_gradients_present_at_each_step():
    """The replica weights copied once per set of present gradients: a parameter without a
    gradient at one step (a frozen or unused one) leaves the others' norm right, as a naive norm."""
    from moefold.parallel.data import GradNormClipper

    params = [torch.nn.Parameter(torch.randn(n)) for n in (3, 4, 5)]
    clip = GradNormClipper(params)
    for present in ([0, 1, 2], [0, 2], [0, 1, 2], [1]):
        for i, p in enumerate(params):
            p.grad = torch.randn_like(p) if i in present else None
        naive = torch.cat([params[i].grad for i in present]).norm()
        torch.testing.assert_close(clip(float("inf")), naive, rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------- gloo layouts

LAYOUTS = {
    "fsdp-world1": (1, dict(parallel__data_parallel="fsdp", train__grad_accum="2")),
    "zero1-world1-precision": (1, dict(parallel__data_parallel="ddp", optim__exp_avg_dtype="fp8",
                                       optim__master_dtype="bf16+remainder")),
    "fsdp-dp2-fp8-moments-remainder": (2, dict(optim__exp_avg_dtype="fp8", optim__exp_avg_sq_dtype="fp8",
                                               optim__master_dtype="bf16+remainder")),
    "tp2-sequence-parallel": (2, dict(parallel__tp="2", model__n_kv_heads="2", moe__pad_multiple="8")),
    "tp2-ep2-folded-zero1": (2, dict(parallel__tp="2", model__n_kv_heads="2", parallel__ep="2",
                                     parallel__data_parallel="ddp")),
    "ep2-alltoall": (2, dict(parallel__ep="2")),
    "etp2-alltoall": (2, dict(parallel__etp="2")),
    "ep2-allgather": (2, dict(parallel__ep="2", parallel__ep_dispatcher="allgather")),
    "ep2-capacity-padded": (2, dict(parallel__ep="2", moe__capacity_factor="1.0", moe__pad_to_capacity="true")),
}


def _layout_case(rank: int, root: Path, overrides: dict) -> None:
    monkeypatch = pytest.MonkeyPatch()
    cfg = tiny_config(root / "corpus", **overrides)
    trainer = Trainer(cfg, root / "run", out=lambda line: None)
    try:
        with recording(monkeypatch) as reads:
            train_between_log_steps(trainer, reads)
    finally:
        monkeypatch.undo()
    found = unexpected(reads.reads)
    assert found == [], f"rank {rank}: {found}"


@pytest.mark.parametrize("world, overrides", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_layouts_read_nothing_from_the_device_between_log_steps(tmp_path, world, overrides):
    write_text_corpus(tmp_path / "corpus")
    run_ranks(world, _layout_case, tmp_path, overrides)
