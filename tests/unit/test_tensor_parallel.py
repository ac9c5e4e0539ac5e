"""Tensor parallelism (apply_tp) against the single-process model, on 2 gloo ranks.

Every rank builds the same model (same seed) and keeps a deep copy as the reference, applies TP (with
and without sequence parallelism) to the other, and runs the same batch through both: logits must match, and after one backward of
(logits · upstream).sum() so must every gradient — TP-sharded weights gathered with full_tensor(),
replicated ones (embeddings, norms, QK-norms, routers, MLA's latent projections) as they are. Under
sequence parallelism each rank's routed experts compute its shard of the tokens, so their gradients
are summed over the ranks first, as expert data parallelism does in a run (parallel/apply.py).
"""

import copy

import pytest
import torch
import torch.distributed as dist
from test_parallel_dims import run_on_ranks
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

from moefold.config import load_config
from moefold.errors import ConfigError
from moefold.fp8.gemm import EmulatedFp8Gemm, HighPrecisionWeightGrad, linear_scaling
from moefold.fp8.linear import Fp8Linear, shard_fp8_linears
from moefold.models.transformer import build_model
from moefold.parallel.dims import ParallelDims, ParallelLayout
from moefold.parallel.tensor import apply_tp
from moefold.parallel.tp_split import tp_local_features

WORLD = 2
VOCAB = 64
B, S = 2, 8
TOL = {"rtol": 1e-5, "atol": 1e-5}

# (preset, overrides): first_k_dense=1 so every GQA model has a dense SwiGLU layer next to an MoE one.
CASES = [
    ("tiny-qwen3", {"moe.first_k_dense": 1}),  # QK-norm, GQA 4/2
    ("tiny-qwen3", {"moe.first_k_dense": 1, "model.tie_embeddings": True}),
    ("tiny-mixtral", {"moe.first_k_dense": 1, "model.sliding_window": 4}),  # window < seq_len
    ("tiny-deepseek", {}),  # MLA with q_lora_rank, dense first layer, an MTP block
    ("tiny-deepseek", {"model.q_lora_rank": 0}),  # MLA with a plain wq
]
# Under sequence parallelism each rank routes its shard of the sequences: the balancing losses (at
# weights large enough for a wrong share to show in the router's gradient), the gated shared expert
# and a padding mask that leaves the ranks different numbers of real tokens.
STRONG_LOSSES = {"moe.aux_loss_coeff": 1.0, "moe.z_loss_coeff": 1.0}
SHARD_CASES = [
    ("tiny-qwen3", {"moe.first_k_dense": 1, **STRONG_LOSSES, "moe.shared_experts": 1,
                    "moe.shared_expert_gate": True}),
    ("tiny-deepseek", {"moe.seq_aux_loss_coeff": 1.0, "moe.global_aux_loss_coeff": 1.0}),
]


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _check_case(preset: str, overrides: dict, tp_mesh, sequence_parallel: bool = False,
                padded: bool = False) -> None:
    cfg = load_config(preset, overrides)
    torch.manual_seed(0)
    model = build_model(cfg, VOCAB)
    model.init_weights(seed=1)
    ref = copy.deepcopy(model)
    apply_tp(model, tp_mesh, sequence_parallel)
    _check_tp_split_table(model, ref)
    seen = []  # what the last block receives: the residual stream between TP regions
    model.layers[-1].register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    gathered = []  # and what it returns, after apply_tp's hooks
    model.layers[-1].register_forward_hook(lambda module, args, out: gathered.append(out))

    sharded = {n for n, p in model.named_parameters()
               if isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)}
    attn0 = model.layers[0].attn
    assert any(".attn.wo." in n for n in sharded) and "layers.0.ffn.w2.weight" in sharded
    assert not any(".experts" in n or "tok_embeddings" in n or "norm" in n for n in sharded), sharded
    assert attn0.n_heads == cfg.model.n_heads // WORLD

    gen = torch.Generator().manual_seed(2)
    ids_BS = torch.randint(0, VOCAB, (B, S), generator=gen)
    upstream_BSV = torch.randn(B, S, VOCAB, generator=gen)
    valid_BS = None
    if padded:  # rank 1's half of sequence 0 is mostly padding, rank 0's whole
        valid_BS = torch.ones(B, S, dtype=torch.bool)
        valid_BS[0, S - 3:] = False
    logits = model(ids_BS, valid_BS)
    logits_ref = ref(ids_BS, valid_BS)
    assert not isinstance(logits, DTensor)
    torch.testing.assert_close(logits, logits_ref, **TOL)
    if sequence_parallel:  # 1/tp of the sequence per rank
        assert isinstance(seen[0], DTensor) and seen[0].placements == (Shard(1),)
        assert seen[0].to_local().shape == (B, S // WORLD, cfg.model.dim)
        # A new tensor, not a view: FSDP2 warns of a view returned by a unit (the last block).
        assert not isinstance(gathered[0], DTensor) and gathered[0]._base is None
    else:
        assert not isinstance(seen[0], DTensor) and seen[0].shape == (B, S, cfg.model.dim)
    (logits * upstream_BSV).sum().backward()
    (logits_ref * upstream_BSV).sum().backward()

    ref_params = dict(ref.named_parameters())
    checked = 0
    for name, p in model.named_parameters():
        p_ref = ref_params[name]
        torch.testing.assert_close(_full(p.detach()), p_ref.detach(), rtol=0, atol=0, msg=name)
        if p_ref.grad is None:
            assert p.grad is None, name
            continue
        assert p.grad is not None, name
        grad = _full(p.grad)
        if sequence_parallel and ".experts." in name and not name.startswith("mtp."):
            dist.all_reduce(grad)  # each rank's routed experts saw its shard of the sequence
        torch.testing.assert_close(grad, p_ref.grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")
        checked += 1
    assert checked > len(sharded)


def _check_tp_split_table(model, ref) -> None:
    """parallel/tp_split.py, which apply_fp8 and the memory planner read before the model is
    parallelized, gives every block linear (main and MTP) the shard apply_tp made."""
    ref_linears = {n: m for n, m in ref.named_modules() if isinstance(m, nn.Linear)}
    split = 0
    for name, linear in model.named_modules():
        if not isinstance(linear, nn.Linear) or not (".attn." in name or ".ffn." in name):
            continue
        weight = linear.weight.to_local() if isinstance(linear.weight, DTensor) else linear.weight
        whole = ref_linears[name]
        in_local, out_local = tp_local_features(name.rpartition(".")[2], whole.in_features,
                                                whole.out_features, WORLD)
        assert weight.shape == (out_local, in_local), name
        split += weight.shape != whole.weight.shape
    assert split >= 4


def _check_replay(preset: str, tp_mesh) -> None:
    """Router replay under sequence parallelism: a recording holds the batch's tokens in sequence
    order, as one process records them, and replaying one process's indices routes alike."""
    cfg = load_config(preset)
    torch.manual_seed(0)
    model = build_model(cfg, VOCAB)
    model.init_weights(seed=1)
    ref = copy.deepcopy(model)
    apply_tp(model, tp_mesh, sequence_parallel=True)
    ids_BS = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(3))
    recorded = {}
    for name, m in (("tp", model), ("ref", ref)):
        with torch.no_grad(), m.router_replay.record():
            m(ids_BS)
        recorded[name] = m.router_replay.recorded()
    assert torch.equal(recorded["tp"], recorded["ref"])
    shifted_TLK = (recorded["ref"] + 1) % cfg.moe.num_experts  # not what the routers would choose
    with torch.no_grad(), model.router_replay.replay(shifted_TLK), ref.router_replay.replay(shifted_TLK):
        logits, logits_ref = model(ids_BS), ref(ids_BS)
    torch.testing.assert_close(logits, logits_ref, **TOL)
    with torch.no_grad():
        assert not torch.allclose(logits, ref(ids_BS), **TOL)  # the replay changed the routing


def _check_backward_collectives(tp_mesh) -> None:
    """One dense block (GQA without QK-norm, SwiGLU MLP): attention's q/k/v and the MLP's gate and
    up read one input each, so its gradient is summed over TP once — one reduce-scatter under
    sequence parallelism, one all-reduce without — not once per linear (5 all-reduces before)."""
    expected = {True: {"all_gather_into_tensor": 3, "reduce_scatter_tensor": 2},  # + row-wise outputs
                False: {"all_reduce": 2}}
    for sequence_parallel, counts in expected.items():
        cfg = load_config("tiny-qwen3", {"model.n_layers": 1, "moe.first_k_dense": 1, "model.qk_norm": False})
        model = build_model(cfg, VOCAB)
        model.init_weights(seed=1)
        apply_tp(model, tp_mesh, sequence_parallel)
        logits = model(torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(4)))
        with CommDebugMode() as comm:
            logits.sum().backward()
        seen = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
        assert seen == counts, f"sequence_parallel={sequence_parallel}"


class CollectiveShapes(TorchDispatchMode):
    """(op, input shape) of every collective dispatched while active: DTensor's functional ones
    and torch.distributed's own (named alike)."""

    NAMES = {"_allgather_base_": "all_gather_into_tensor", "_reduce_scatter_base_": "reduce_scatter_tensor",
             "allreduce_": "all_reduce"}

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and "wait" not in name:
            self.seen.append((name, tuple(args[0].shape)))
        elif func.namespace == "c10d" and name in self.NAMES:  # (output, input, ...) / ([tensors], ...)
            first = args[1] if name != "allreduce_" else args[0][0]
            self.seen.append((self.NAMES[name], tuple(first.shape)))
        return func(*args, **(kwargs or {}))

    def widths(self, op: str) -> list[int]:
        return [shape[-1] for name, shape in self.seen if name == op]


def _check_mla_gathers_latents(tp_mesh) -> None:
    """Under sequence parallelism MLA projects the rank's shard down and all-gathers the latents
    (Megatron-Core's order), not the D-wide normed x: in a dense MLA block the forward all-gathers
    the RoPE key (Dr), the query latent (Q) and the key/value latent (C), then the MLP's input and
    the last block's output (D); backward reduce-scatters those three gradients and all-reduces
    nothing (the replicated weights' partial gradients are summed where data parallelism reduces
    them). Without q-LoRA, wq reads x itself and gathers it (D)."""
    for q_lora, gathered in ((16, "Q"), (0, "D")):
        cfg = load_config("tiny-deepseek", {"model.n_layers": 1, "model.mtp_layers": 0,
                                            "model.q_lora_rank": q_lora})
        m = cfg.model
        D, Dr, C, Q = m.dim, m.qk_rope_head_dim, m.kv_lora_rank, q_lora or m.dim
        assert len({D, Dr, C, Q}) == 4 or not q_lora
        model = build_model(cfg, VOCAB)
        model.init_weights(seed=1)
        apply_tp(model, tp_mesh, sequence_parallel=True)
        with CollectiveShapes() as forward:
            logits = model(torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(4)))
        with CollectiveShapes() as backward:
            logits.sum().backward()
        assert forward.widths("all_gather_into_tensor") == [Dr, Q, C, D, D], gathered
        assert sorted(backward.widths("reduce_scatter_tensor")) == sorted([Dr, Q, C, D]), gathered
        assert backward.widths("all_reduce") == [], gathered


def _check_fp8_token_shards(tp_mesh) -> None:
    """An FP8 linear with a replicated weight reading the rank's sequence shard (MLA's
    down-projections under sequence parallelism; fp8/linear.TokenShards). Rowwise scales are per
    token and per weight column, so the output and the input's gradient equal one process's bit for
    bit; the weight's gradient (unquantized: precision.fp8_weight_grad=bf16) is the ranks' parts
    summed."""
    torch.manual_seed(5)
    linear = nn.Linear(32, 16, bias=False)
    gemm, scaling = HighPrecisionWeightGrad(EmulatedFp8Gemm()), linear_scaling("rowwise")
    ref = Fp8Linear.from_linear(copy.deepcopy(linear), gemm, scaling)
    fp8 = Fp8Linear.from_linear(linear, gemm, scaling)
    parallelize_module(fp8, tp_mesh, SequenceParallel())
    shard_fp8_linears(fp8)
    gen = torch.Generator().manual_seed(6)
    x_BSK, upstream_BSN = torch.randn(B, S, 32, generator=gen), torch.randn(B, S, 16, generator=gen)
    x_ref = x_BSK.clone().requires_grad_()
    y_ref = ref(x_ref)
    (y_ref * upstream_BSN).sum().backward()
    x = x_BSK.clone().requires_grad_()
    y = fp8(DTensor.from_local(x, tp_mesh, (Replicate(),)).redistribute(tp_mesh, (Shard(1),)))
    assert y.placements == (Shard(1),)
    (y.full_tensor() * upstream_BSN).sum().backward()
    assert torch.equal(y.full_tensor(), y_ref) and torch.equal(x.grad, x_ref.grad)
    torch.testing.assert_close(fp8.weight.grad.full_tensor(), ref.weight.grad, **TOL)


def _check_all(rank: int) -> None:
    tp_mesh = ParallelLayout(ParallelDims(WORLD, tp=WORLD)).tp_mesh
    for preset, overrides in CASES:
        _check_case(preset, overrides, tp_mesh)
        _check_case(preset, overrides, tp_mesh, sequence_parallel=True)
    for preset, overrides in SHARD_CASES:
        _check_case(preset, overrides, tp_mesh, padded=True)
        _check_case(preset, overrides, tp_mesh, sequence_parallel=True, padded=True)
    _check_replay("tiny-qwen3", tp_mesh)
    _check_backward_collectives(tp_mesh)
    _check_mla_gathers_latents(tp_mesh)
    _check_fp8_token_shards(tp_mesh)

    # A sequence the TP ranks cannot split evenly under sequence parallelism: one clear error
    # (it was a broadcast of unequal shards deep in the residual stream).
    model = build_model(load_config("tiny-qwen3"), VOCAB)
    apply_tp(model, tp_mesh, sequence_parallel=True)
    with pytest.raises(ValueError, match="^sequence parallelism splits each sequence over the 2 TP ranks: "
                                         "a sequence of 7 positions is not a multiple of 2; pad it$"):
        model(torch.zeros(2, 7, dtype=torch.long))

    # Indivisible heads: a ConfigError, before anything is sharded.
    for overrides, what in [({"model.n_heads": 3, "model.n_kv_heads": 1, "model.head_dim": 16}, "n_heads=3"),
                            ({"model.n_heads": 4, "model.n_kv_heads": 1}, "n_kv_heads=1")]:
        model = build_model(load_config("tiny-qwen3", overrides), VOCAB)
        with pytest.raises(ConfigError, match=f"parallel.tp=2 does not divide model.{what}"):
            apply_tp(model, tp_mesh)
        assert not any(isinstance(p, DTensor) for p in model.parameters())


def test_tensor_parallel_matches_single_process():
    run_on_ranks(_check_all, WORLD)
