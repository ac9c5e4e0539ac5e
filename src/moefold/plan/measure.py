"""The independent check of the memory planner: run the real model for one forward and backward
under `FakeTensorMode` (shapes and dtypes, no memory) and measure what autograd keeps for backward.

Every tensor saved for backward goes through a `saved_tensors_hooks` pack hook; its *storage* is
counted once (views of one buffer share it), parameters excluded. Each storage is charged to the
innermost module running when an op first saved it, mapped to the planner's categories (`CATEGORIES`
in `plan.activations`), so the analytic model can be compared module by module, not only in total
(with memory.recompute, a storage only a recompute keeps, as a checkpoint's or an output-discarding
producer's input, to `kept_inputs`);
casts of parameters (autocast's bf16 weights, the experts' `w.to(bf16)`, fp32 norm weights), seen
by a dispatch mode as `_to_copy` of a parameter's storage, are charged to `weight_copies`.
For small configs (the planner's formulas are what scale); single process, or (for real) one rank's
share of a tensor-parallel model, where a DTensor counts its local shard's storage.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from moefold.config import Config
from moefold.data.tokenizer import model_vocab_size
from moefold.parallel.dims import ParallelLayout
from moefold.parallel.local import memory_holder

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class SavedActivations:
    """Bytes autograd keeps between forward and backward, by category and by scope."""
    by_category: dict[str, int] = field(default_factory=dict)
    by_scope: dict[str, int] = field(default_factory=dict)  # "layer 3", "mtp 1", "model"
    host: int = 0  # memory.offload's host copies still held when forward ends
    host_peak: int = 0  # ... at their most from then through backward (`host`: a recomputed
    # region's offloaded sites copy nothing when backward runs them again)

    @property
    def total(self) -> int:
        return sum(self.by_category.values())

    def add(self, scope: str, category: str, nbytes: int) -> None:
        self.by_category[category] = self.by_category.get(category, 0) + nbytes
        self.by_scope[scope] = self.by_scope.get(scope, 0) + nbytes


def _category(module: nn.Module, parent: nn.Module | None) -> str:
    """The planner category of a tensor saved while `module` (innermost) ran inside `parent`."""
    from moefold.models.attention import Attention
    from moefold.models.mla import MLAttention
    from moefold.models.mlp import SwiGLUMLP
    from moefold.models.norm import RMSNorm
    from moefold.moe.balance import LoadBalancer
    from moefold.moe.experts import Experts
    from moefold.moe.layer import MoELayer
    from moefold.moe.router import Router
    from moefold.moe.shared import SharedExperts

    if isinstance(module, RMSNorm):
        return "norm"
    if isinstance(module, nn.Linear) and isinstance(parent, (Attention, MLAttention)):
        return "attn_proj"
    if isinstance(module, (Attention, MLAttention)):
        return "attn_core"
    if isinstance(module, Experts):
        return "experts"
    if isinstance(module, MoELayer):
        return "moe_dispatch"
    if isinstance(module, SwiGLUMLP):
        return "mlp"
    for owner in (module, parent):
        if isinstance(owner, SharedExperts):
            return "shared_experts"
        if isinstance(owner, SwiGLUMLP):
            return "mlp"
    if isinstance(module, (Router, LoadBalancer)):  # a subclass too (ShardRoutingRouter under SP)
        return "router"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if type(module).__name__ == "MTPModule" or (parent is not None and type(parent).__name__ == "MTPModule"):
        return "mtp_proj"
    return "head"  # the output head and the loss (run outside any block)


def _scope(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) > 1:
        return f"layer {parts[1]}"
    if parts[0] == "mtp" and len(parts) > 2:
        return f"mtp {int(parts[2]) + 1}"
    return "model"


def _storage_key(t: torch.Tensor) -> int:
    """The storage a tensor holds on this rank: a DTensor's is its local shard's."""
    return memory_holder(t).untyped_storage()._cdata


@dataclass
class _Saved:
    storage: torch.UntypedStorage  # its size is read when forward ends (recompute may free it)
    scope: str
    category: str
    refs: list = field(default_factory=list)

    def alive(self) -> bool:
        """Graph nodes whose outputs nobody uses are freed during forward, with what they saved."""
        return any(ref() is not None for ref in self.refs)


class _ModuleStack:
    """The innermost running module (and its parent), kept by forward hooks."""

    def __init__(self, model: nn.Module):
        self.stack: list[tuple[str, nn.Module]] = []
        self.handles = []
        for name, module in model.named_modules():
            if module is model:
                continue
            self.handles.append(module.register_forward_pre_hook(self._push(name)))
            self.handles.append(module.register_forward_hook(self._pop, always_call=True))

    def _push(self, name):
        def hook(module, args):
            self.stack.append((name, module))
        return hook

    def _pop(self, module, args, output):
        self.stack.pop()

    def where(self) -> tuple[str, str]:
        if not self.stack:
            return "model", "head"
        name, module = self.stack[-1]
        parent = self.stack[-2][1] if len(self.stack) > 1 else None
        return _scope(name), _category(module, parent)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class _FusedAttentionStandIn(torch.autograd.Function):
    """What a fused GPU attention kernel (FlashAttention-2, cuDNN, memory-efficient) keeps for
    backward: q, k, v, the output (in B,S,H,Dv memory order, so the output projection's reshape is
    a view) and the fp32 log-sum-exp [B, H, S]; an attention mask as a bias in q's dtype. The CPU
    has no fused kernel for every shape (MLA's Dk ≠ Dv falls back to the math path, which keeps the
    [S, S] probabilities), so the check would otherwise measure a CPU artefact."""

    @staticmethod
    def forward(ctx, q_BHSD, k_BGSD, v_BGSD, attn_mask, kwargs):
        with torch.no_grad():
            out_BHSD = _REAL_SDPA(q_BHSD, k_BGSD, v_BGSD, attn_mask=attn_mask, **kwargs)
        out_BHSD = out_BHSD.transpose(1, 2).contiguous().transpose(1, 2)
        B, H, S, _ = q_BHSD.shape
        lse_BHS = q_BHSD.new_empty(B, H, S, dtype=torch.float32)
        bias = () if attn_mask is None else (attn_mask.to(q_BHSD.dtype),)
        ctx.save_for_backward(q_BHSD, k_BGSD, v_BGSD, out_BHSD, lse_BHS, *bias)
        ctx.attn_mask, ctx.kwargs = attn_mask, kwargs
        return out_BHSD

    @staticmethod
    def backward(ctx, grad_BHSD):
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors[:3])
        with torch.enable_grad():
            out = _REAL_SDPA(q, k, v, attn_mask=ctx.attn_mask, **ctx.kwargs)
        return (*torch.autograd.grad(out, (q, k, v), grad_BHSD), None, None)


_REAL_SDPA = torch.nn.functional.scaled_dot_product_attention


def _fused_sdpa(q, k, v, attn_mask=None, **kwargs):
    return _FusedAttentionStandIn.apply(q, k, v, attn_mask, kwargs)


@contextlib.contextmanager
def _fused_attention():
    torch.nn.functional.scaled_dot_product_attention = _fused_sdpa
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = _REAL_SDPA


@contextlib.contextmanager
def _memory_wrappers_seen(pack, seen: _WrappersSeen):
    """Let the measurement see through memory.recompute and memory.offload: an output-discarding
    producer holds its tensor inputs itself, and a checkpoint its keyword arguments (the recompute
    closure does), which no saved-tensor hook reports; a checkpoint's positional inputs need
    nothing, torch.utils.checkpoint saving them through the saved-tensor hooks around it (pack, or
    an offloaded site's, which copies them to the host), before it runs the site (`seen.inputs`
    says when). An offloaded site's own hooks hide what it saved, so the tensors its offload leaves
    on the device (too small, parameters and their casts) are reported here (its host copies are
    followed by `_HostCopies`). The outputs that output-discarding frees count 0 because sizes are
    read when forward ends."""
    from moefold.memory import offload, recompute

    real_checkpoint, real_forward, real_pack = recompute.checkpoint, recompute._Run.forward, \
        offload.ActivationOffload.pack

    def hold(tensors):
        for t in tensors:
            if isinstance(t, torch.Tensor):
                pack(t, kept_input=True)
                seen.held.append(t)  # a strong reference, as the wrapper holds it

    def checkpoint(fn, *args, **kwargs):
        hold(kwargs.values())

        def site(*a, **k):
            seen.inputs = False  # its inputs are saved: what follows, the site's ops save
            return fn(*a, **k)
        seen.inputs = True
        try:
            return real_checkpoint(site, *args, **kwargs)
        finally:
            seen.inputs = False

    def forward(run, args):
        hold(run.args)
        return real_forward(run, args)

    def offload_pack(self, t):
        packed = real_pack(self, t)
        if packed is t:  # stays on the device
            pack(t, kept_input=seen.inputs)
        return packed

    recompute.checkpoint, recompute._Run.forward = checkpoint, forward
    offload.ActivationOffload.pack = offload_pack
    try:
        yield
    finally:
        recompute.checkpoint, recompute._Run.forward = real_checkpoint, real_forward
        offload.ActivationOffload.pack = real_pack


@dataclass
class _WrappersSeen:
    """What memory.recompute keeps as inputs: held here until the caller has counted them."""
    held: list[torch.Tensor] = field(default_factory=list)  # producers' inputs, checkpoints' kwargs
    inputs: bool = False  # a checkpoint is saving its positional inputs


class _HostCopies:
    """memory.offload's host copies, one per storage and site call, followed from forward through
    backward: the bytes they hold now (`live`) and at most since `from_now` (`peak`). A copy lives
    until autograd releases the last tensor saved on it (followed weakly), as the pinned copy on a
    GPU does."""

    def __init__(self):
        self.live = self.peak = 0
        self._seen: weakref.WeakSet = weakref.WeakSet()

    @contextlib.contextmanager
    def followed(self):
        from moefold.memory import offload

        real = offload.ActivationOffload._host_copy

        def host_copy(offload_self, local):
            copy = real(offload_self, local)
            if copy not in self._seen:  # a new copy (the region's table shares one per storage)
                self._seen.add(copy)
                self.live += copy.host_B.nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(copy, self._release, copy.host_B.nbytes)
            return copy
        offload.ActivationOffload._host_copy = host_copy
        try:
            yield self
        finally:
            offload.ActivationOffload._host_copy = real

    def from_now(self) -> None:
        self.peak = self.live

    def _release(self, nbytes: int) -> None:
        self.live -= nbytes


class _ParamCasts(TorchDispatchMode):
    """Storages made by casting a parameter (`_to_copy` of a parameter's storage). Holds them, so
    their addresses are not reused by other tensors while forward runs."""

    def __init__(self, params: set[int]):
        super().__init__()
        self.params, self.casts = params, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and _storage_key(args[0]) in self.params:
            self.casts[_storage_key(out)] = out
        return out


def _cast_params(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model.to(dtype)` for fake parameters (`Module.to` cannot swap them); ties kept."""
    cast: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.dtype != dtype:
                module._parameters[name] = cast.setdefault(id(p), nn.Parameter(p.detach().to(dtype)))
    return model


def measure_saved_activations(cfg: Config, dtype: str = "bf16", vocab_size: int = 0, param_dtype: str = "",
                              layout: ParallelLayout | None = None) -> SavedActivations:
    """Saved-for-backward bytes of one training micro-batch (cfg.train.micro_batch_size ×
    cfg.train.seq_len) of the real model, run in `dtype` (bf16: under bf16 autocast, as on GPU;
    fp32) under FakeTensorMode, with parameters in `param_dtype` (default `dtype`; "fp32" with bf16
    autocast is the fp32-master run). Runs backward too, so a model that cannot differentiate fails
    here.

    fp32 runs for real on the CPU instead (keep the config small): grouped_mm's fake kernel takes
    bf16 only, and the loop backend needs real token counts. With a `layout` (every rank of its
    process group calling) the model is parallelized as the trainer does it, and this rank's bytes
    are measured; bf16 then runs for real too (on the CPU, under autocast), as collectives need
    real tensors. So it does with memory.recompute or memory.offload: output discarding tells a
    site's outputs from its inputs by their storages' addresses and offload moves plain tensors,
    and fake tensors have neither (under them nothing would be freed or moved)."""
    from moefold.fp8.apply import apply_fp8
    from moefold.fp8.weight_cache import refresh_weight_caches
    from moefold.models.transformer import build_model
    from moefold.moe.experts import grouped_mm_supported
    from moefold.train.loss import build_head_loss, build_objective

    torch_dtype, param_torch_dtype = DTYPES[dtype], DTYPES[param_dtype or dtype]
    grouped_mm_supported("cpu", torch_dtype)  # cached probe with real tensors, outside fake mode
    vocab = vocab_size or model_vocab_size(cfg)
    B, S = cfg.train.micro_batch_size, cfg.train.seq_len
    real = dtype == "fp32" or layout is not None or bool(cfg.memory.recompute or cfg.memory.offload)
    fake = contextlib.nullcontext() if real else FakeTensorMode()
    with fake, _fused_attention():
        model = build_model(cfg, vocab, "cpu", torch_dtype)
        apply_fp8(model, cfg.precision, "cpu", shared_inputs=param_torch_dtype == torch_dtype,
                  compute_dtype=torch_dtype, sequence_parallel=layout is not None and cfg.parallel.shards_sequence,
                  tp=cfg.parallel.tp if layout is not None else 1,
                  etp=cfg.parallel.etp if layout is not None else 1)
        model = _cast_params(model, param_torch_dtype).train()
        refresh_weight_caches(model)  # precision.fp8_weight_cache's buffers: not activations
        if real:
            model.init_weights(cfg.train.seed)  # uninitialised memory may hold slow denormals
        if layout is not None:
            _parallelize(model, layout, cfg)
        params = {_storage_key(p) for p in model.parameters()}
        params |= {_storage_key(b) for b in model.buffers()}
        ids_BS = torch.randint(0, vocab, (B, S))
        labels_BS = torch.randint(0, vocab, (B, S))
        stack = _ModuleStack(model)
        saved: dict[int, _Saved] = {}
        param_casts = _ParamCasts(params)

        wrappers = _WrappersSeen()

        def pack(t: torch.Tensor, kept_input: bool = False) -> torch.Tensor:
            """A storage counts where an op first saved it, as `kept_inputs` where only recompute
            keeps it (as the planner charges it)."""
            key = _storage_key(t)
            if key in params:
                return t
            entry = saved.get(key)
            kept_input = kept_input or wrappers.inputs
            if entry is None or not entry.alive():  # a dead entry's address was reused
                scope, category = stack.where()
                entry = saved[key] = _Saved(memory_holder(t).untyped_storage(), scope,
                                            "kept_inputs" if kept_input else category)
            elif entry.category == "kept_inputs" and not kept_input:
                entry.scope, entry.category = stack.where()
            if key in param_casts.casts:
                entry.category = "weight_copies"
            entry.refs.append(weakref.ref(t))
            return t

        autocast = (torch.autocast("cpu", dtype=torch_dtype) if torch_dtype != torch.float32
                    else contextlib.nullcontext())
        # The head loss the trainer builds from the config, eager: what the planner models.
        objective = build_objective(model, build_head_loss(cfg.train.loss_chunk_tokens, compiled=False))
        with _HostCopies().followed() as host_copies:
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast, \
                        _memory_wrappers_seen(pack, wrappers), param_casts:
                    loss, _ = objective(model, ids_BS, labels_BS)
            finally:
                stack.remove()
            result = SavedActivations(host=host_copies.live)
            host_copies.from_now()  # (forward's own peak can hold copies of nodes forward freed)
            for entry in saved.values():
                if entry.alive():  # saved by a graph node that backward will run
                    result.add(entry.scope, entry.category, entry.storage.nbytes())
            wrappers.held.clear()  # the kept inputs are counted: the wrappers alone hold them now
            param_casts.casts.clear()
            loss.backward()
        result.host_peak = host_copies.peak
    return result


def _parallelize(model: nn.Module, layout: ParallelLayout, cfg: Config) -> None:
    """The trainer's parallelization of a filled model, with ZeRO-1 for data parallelism: FSDP's
    gathered parameters are storages of their own, which would be counted as activations."""
    from moefold.parallel.apply import parallelize

    parallelize(model, layout, replace(cfg.parallel, data_parallel="ddp"))
