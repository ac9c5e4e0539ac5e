"""Short training runs of the tiny presets for the recompute and offload tests, keeping everything
those features must leave unchanged: losses, gradients, MoE statistics and counts, the recorded
routing and the RNG stream."""

from dataclasses import dataclass, replace

import pytest
import torch

from moefold.config import load_config
from moefold.fp8.apply import apply_fp8
from moefold.models.transformer import build_model
from moefold.moe.experts import Fp8GroupedExperts
from moefold.parallel.apply import parallelize
from moefold.parallel.dims import ParallelLayout
from moefold.parallel.local import local_tensor
from moefold.train.loss import build_objective

VOCAB = 64
SMALL = {"model.dim": "32", "model.n_layers": "2", "train.seq_len": "16", "train.micro_batch_size": "2"}
# Each preset's structure, plus the MoE features whose recording or randomness a recompute could
# repeat: global-batch aux loss and z-loss (qwen3), capacity drops (deepseek), input jitter (mixtral).
CONFIGS = {
    "qwen3": ("tiny-qwen3", {"moe.global_aux_loss_coeff": "0.01", "moe.z_loss_coeff": "0.001"}),
    # MLA with q-LoRA, shared expert, sigmoid router with expert bias, sequence aux loss, MTP.
    "deepseek": ("tiny-deepseek", {"moe.capacity_factor": "1.5"}),
    "mixtral": ("tiny-mixtral", {"moe.input_jitter": "0.1"}),
}
# The names of config.MEMORY_MODULES each config has (the config refuses the others).
MODULES = {
    "qwen3": ["norm", "attn_core", "moe_act", "moe", "layer"],
    "deepseek": ["norm", "attn_core", "mla_up_proj", "moe_act", "shared_experts", "mlp", "moe", "layer"],
    "mixtral": ["norm", "attn_core", "moe_act", "moe", "layer"],
}
# Every (config, module name) pair: the cases the recompute and offload tests run.
CASES = [(config, name) for config in CONFIGS for name in MODULES[config]]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Import into a test module. Ops this small gain nothing from OpenMP threads, and on a shared
    2-core machine their spinning made a 50 ms run take seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class Run:
    losses: list[torch.Tensor]
    grads: list[dict[str, torch.Tensor]]  # per optimizer step, before the update
    moe: list[list[dict[str, torch.Tensor]]]  # per step, per MoE layer: stats, step and global counts
    routing_TLK: torch.Tensor  # router replay's recording of every micro-batch
    rng_after: torch.Tensor


def build(config: str, overrides: dict[str, str] | None = None, device_type: str = "cpu",
          layout: ParallelLayout | None = None):
    """The model of `config`; with a `layout` (every rank of it calling), this rank's share of it,
    parallelized as the trainer does (ZeRO-1 for data ranks: `train` steps the full parameters)."""
    preset, extra = CONFIGS[config]
    cfg = load_config(preset, {**SMALL, **extra, **(overrides or {})})
    model = build_model(cfg, VOCAB, device_type)
    model.init_weights(seed=0)
    if layout is not None:
        parallelize(model, layout, replace(cfg.parallel, data_parallel="ddp"))
    return model.train()


# The FP8 recipes the memory options are tested with, and the dims each needs (blockwise: 128).
FP8_RECIPES = {"rowwise": {}, "blockwise": {"model.dim": "128", "moe.expert_hidden": "128"}}


def fp8_overrides(recipe: str, overrides: dict[str, str] | None = None) -> dict[str, str]:
    return {**FP8_RECIPES[recipe], "precision.fp8": recipe, **(overrides or {})}


def fp8_model(config: str, recipe: str, overrides: dict[str, str] | None = None):
    """build()'s model (memory options wrapped at build time), then converted as the trainer
    converts it: apply_fp8 after build_model."""
    model = build(config, fp8_overrides(recipe, overrides))
    apply_fp8(model, model.cfg.precision, "cpu")
    assert all(isinstance(layer.experts, Fp8GroupedExperts) for layer in model.moe_layers())
    return model


def rowwise_fp8_h_bytes(model, ids_BS: torch.Tensor) -> int:
    """The bytes of a rowwise FP8 copy of each MoE layer's activation output h (R routed rows by F
    expert hidden features) for a forward of ids_BS, from the shapes: R·F values of 1 byte, R fp32
    row scales."""
    T = ids_BS.shape[0] * (ids_BS.shape[1] - 1)
    rows_F = [(layer.dispatcher.layout.num_rows(T * layer.top_k), layer.experts.w2_EFD.shape[1])
              for layer in model.moe_layers()]
    return sum(R * F + R * 4 for R, F in rows_F)


def batches(count: int, device="cpu", seq_len: int = 16) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, seq_len + 1), generator=gen).to(device) for _ in range(count)]


def train(model, steps: int = 2, accum: int = 2, device="cpu") -> Run:
    """Like Trainer.train_step: accumulate `accum` micro-batches, AdamW, the MoE step hooks."""
    for layer in model.moe_layers():
        layer.aux_loss_scale = 1.0 / accum
    objective = build_objective(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads, moe = [], [], []
    torch.manual_seed(0)  # router jitter draws from the global RNG
    with model.router_replay.record():
        data = iter(batches(steps * accum, device))
        for _ in range(steps):
            for _ in range(accum):
                ids = next(data)
                total, _ = objective(model, ids[:, :-1], ids[:, 1:])
                (total / accum).backward()
                losses.append(total.detach())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            moe.append([_moe_state(layer) for layer in model.moe_layers()])
            optimizer.step()
            model.on_optimizer_step()
            optimizer.zero_grad(set_to_none=True)
    return Run(losses, grads, moe, model.router_replay.recorded(), torch.get_rng_state())


_plain_runs: dict[str, Run] = {}


def plain_run(config: str) -> Run:
    """The plain (no recompute, no offload) run of `config`, trained once per test process."""
    if config not in _plain_runs:
        _plain_runs[config] = train(build(config))
    return _plain_runs[config]


def _moe_state(layer) -> dict[str, torch.Tensor]:
    return {"step_tokens": layer.step_tokens_per_expert_E.clone(),
            "global_counts": layer.balancer.global_counts_E.clone(),
            "global_tokens": layer.balancer.global_tokens.clone(), **layer.stats.pop()}


def assert_identical(run: Run, ref: Run) -> None:
    """Bit for bit: torch.equal everywhere (this rank's shard of a DTensor gradient)."""
    assert len(run.losses) == len(ref.losses)
    for i, (a, b) in enumerate(zip(run.losses, ref.losses)):
        assert torch.equal(a, b), f"loss of micro-batch {i}: {a.item()} != {b.item()}"
    for step, (g, g_ref) in enumerate(zip(run.grads, ref.grads)):
        assert g.keys() == g_ref.keys()
        differ = [name for name in g if not torch.equal(local_tensor(g[name]), local_tensor(g_ref[name]))]
        assert not differ, f"step {step}: gradients of {differ} differ"
    for step, (layers, layers_ref) in enumerate(zip(run.moe, ref.moe)):
        for i, (state, state_ref) in enumerate(zip(layers, layers_ref)):
            assert state.keys() == state_ref.keys()
            differ = [k for k in state if not torch.equal(state[k], state_ref[k])]
            assert not differ, f"step {step}, MoE layer {i}: {differ} differ: " + str(
                {k: (state[k].tolist(), state_ref[k].tolist()) for k in differ})
    assert torch.equal(run.routing_TLK, ref.routing_TLK), "router replay recorded other routing"
    assert torch.equal(run.rng_after, ref.rng_after), "the RNG stream moved"


class SavedBytes:
    """Bytes of the distinct non-parameter storages a forward leaves for backward: the tensors
    saved under outer saved-tensor hooks (a checkpointed or offloaded site's own hooks hide
    theirs) plus the inputs each checkpoint and output-discarding producer keeps. Measured after the forward, so
    storages freed by output discarding count 0."""

    def __init__(self, model, monkeypatch):
        from moefold.memory import recompute

        self.storages: dict[int, torch.UntypedStorage] = {}
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        checkpoint = recompute.checkpoint

        def keeping_inputs(fn, *args, **kwargs):
            for a in (*args, *kwargs.values()):
                if isinstance(a, torch.Tensor):
                    self._keep(a)
            return checkpoint(fn, *args, **kwargs)
        monkeypatch.setattr(recompute, "checkpoint", keeping_inputs)
        run_forward = recompute._Run.forward

        def keeping_args(run, args):  # an output-discarding producer keeps its inputs on the run
            for a in run.args:
                if isinstance(a, torch.Tensor):
                    self._keep(a)
            return run_forward(run, args)
        monkeypatch.setattr(recompute._Run, "forward", keeping_args)

    def _keep(self, t: torch.Tensor) -> torch.Tensor:
        # By the storage itself, not its address: output discarding frees a kept storage in
        # forward, and a later one may take its address (it was then left out).
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.storages.setdefault(storage._cdata, storage)
        return t

    def of_forward(self, model, ids_BS: torch.Tensor) -> int:
        objective = build_objective(model)
        with torch.autograd.graph.saved_tensors_hooks(self._keep, lambda t: t):
            total, _ = objective(model, ids_BS[:, :-1], ids_BS[:, 1:])
        nbytes = sum(s.nbytes() for s in self.storages.values())
        total.backward()  # backward still works after the measurement
        self.storages.clear()
        return nbytes
