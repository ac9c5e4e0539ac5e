"""Parameter counts and training FLOPs by Megatron's convention.

Training FLOPs per token = 6 · active parameters (every matrix a token passes through, the output
head included, the embedding lookup excluded; a routed expert counts K/E of its weights)
+ causal attention: 3 · L · S · H · (Dh_qk + Dh_v)  (QKᵀ and AV, forward 2·S·H·Dh each, halved by
the causal mask, times 3 for forward + backward); a sliding window of W < S keys puts 2W − W²/S in
place of S. docs/metrics.md derives it.
"""

import contextlib
from dataclasses import dataclass, replace

import torch
from torch import nn

from moefold.errors import ConfigError
from moefold.moe.experts import Experts

# Datasheet dense bf16 TFLOP/s (no sparsity) by device-name fragment, for MFU; the longest fragment
# in the name wins. A family's PCIe and NVL cards run at lower clocks than its SXM one.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "H20": 148.0, "A100": 312.0,
                    "H100 PCIe": 756.0, "H800 PCIe": 756.0, "H100 NVL": 835.5, "H200 NVL": 835.5,
                    "B200": 2250.0, "GB200": 2500.0, "B300": 2500.0, "GB300": 2500.0, "L40S": 362.0}


@dataclass(frozen=True)
class ParamCounts:
    total: int  # every distinct parameter
    active: int  # what one token multiplies by: routed experts scaled by K/E, no embedding lookup
    embedding: int
    tied: bool = False  # the embedding is the output head (so already in `active`)
    mtp: int = 0  # parameters of the multi-token-prediction modules (in total and active)
    mtp_active: int = 0

    @property
    def active_with_embedding(self) -> int:
        """Active parameters as model cards count them: the embedding table included."""
        return self.active if self.tied else self.active + self.embedding

    # What every output prints (`params_line`, `describe_params`): DeepSeek-V3's convention, whose
    # card's 671B total and 37B activated hold the embedding and output head but not the MTP module
    # (its checkpoint's 14B more), printed apart.
    @property
    def main_total(self) -> int:
        """Parameters of the model without its MTP modules."""
        return self.total - self.mtp

    @property
    def main_active(self) -> int:
        """Active parameters without the MTP modules: embedding and output head in."""
        return self.active_with_embedding - self.mtp_active


def params_line(total: int, active: int, mtp: int = 0, mtp_active: int = 0) -> str:
    """The model's size as training's header and `moefold bench` print it, from a ParamCounts'
    `main_total`, `main_active`, `mtp` and `mtp_active`."""
    line = f"{in_units(total)} parameters, {in_units(active)} active"
    return line + (f" (MTP modules: {in_units(mtp)} more, {in_units(mtp_active)} active)" if mtp else "")


def count_params(model: nn.Module) -> ParamCounts:
    total, active = _count(model, model.named_parameters(remove_duplicate=False), model.cfg)
    mtp_total = mtp_active = 0
    if getattr(model, "mtp", None) is not None:
        mtp_total, mtp_active = _count(model.mtp, model.mtp.named_parameters(prefix="mtp"), model.cfg)
    return ParamCounts(total=total, active=active, embedding=model.tok_embeddings.weight.numel(),
                       tied=model.cfg.model.tie_embeddings, mtp=mtp_total, mtp_active=mtp_active)


def _count(model: nn.Module, named_params, cfg) -> tuple[int, int]:
    top_k = cfg.moe.top_k
    total = active = 0
    counted: set[int] = set()
    experts_params = {id(p): m.num_experts for m in model.modules() if isinstance(m, Experts)
                      for p in m.parameters()}
    for name, p in named_params:
        if id(p) in counted:
            continue
        counted.add(id(p))
        total += p.numel()
        if id(p) in experts_params:
            active += p.numel() * top_k // experts_params[id(p)]
        elif not name.startswith("tok_embeddings") or cfg.model.tie_embeddings:
            active += p.numel()  # a tied embedding is counted once, as the output head
    return total, active


def attention_flops_per_token(n_layers: int, seq_len: int, n_heads: int, qk_head_dim: int,
                              v_head_dim: int, window: int = 0) -> int:
    """Forward+backward FLOPs of QKᵀ and AV per token: 6 · H · (Dh_qk + Dh_v) per key a query
    attends to, times the keys a query sees on average: S/2 under the causal mask; with a sliding
    `window` of W < S keys (the token itself included), the band's area over S, W − W²/(2S): a
    query past the first W sees W keys (a window of 4,096 at S = 32,768: 0.23 of the causal count)."""
    # twice the (query, key) pairs of a sequence: the triangle's S²/2, or the band's S·W − W²/2
    pairs_x2 = seq_len ** 2 if not 0 < window < seq_len else 2 * window * seq_len - window ** 2
    return 3 * n_layers * n_heads * (qk_head_dim + v_head_dim) * pairs_x2 // seq_len


def train_flops_per_token(model: nn.Module, seq_len: int) -> int:
    """MTP modules count like layers (their blocks and eh_proj are in `active`), and each uses the
    shared output head once more."""
    return _train_flops_per_token(model.cfg, count_params(model).active, model.output.weight.numel(), seq_len)


def _train_flops_per_token(cfg, active: int, head: int, seq_len: int) -> int:
    """`train_flops_per_token` of a model with `active` parameters and an output head of `head`."""
    m = cfg.model
    if m.attention == "mla":
        qk_dim, v_dim = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    else:
        qk_dim = v_dim = m.head_dim or m.dim // m.n_heads
    return (6 * active + 6 * m.mtp_layers * head
            + attention_flops_per_token(m.n_layers + m.mtp_layers, seq_len, m.n_heads, qk_dim, v_dim,
                                        m.sliding_window))


def peak_tflops(device: torch.device, configured: float) -> float | None:
    """Peak dense bf16 TFLOP/s of one device for MFU: the configured value, else a datasheet lookup
    by GPU name; None on CPU or an unknown GPU."""
    if configured > 0:
        return configured
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    matches = [k for k in PEAK_BF16_TFLOPS if k in name]
    return PEAK_BF16_TFLOPS[max(matches, key=len)] if matches else None


def meta_model(cfg):
    """The model of `cfg` built on the meta device: shapes without memory, for any size."""
    from moefold.data.tokenizer import model_vocab_size
    from moefold.models.transformer import build_model

    vocab_size = model_vocab_size(cfg)  # read before the meta device is entered
    with torch.device("meta"):
        return build_model(cfg, vocab_size)


def config_param_counts(cfg, vocab_size: int) -> ParamCounts:
    """`count_params(meta_model(cfg))` without building every block: the embedding, final norm and
    head, and one block (and MTP module) of each kind, dense and MoE, on the meta device, times how
    many of each the model has. A model of 10^8 layers counts as fast as one of 2."""
    from moefold.models.mtp import MTPModule
    from moefold.models.transformer import Transformer

    m = cfg.model
    main, mtp = range(m.n_layers), range(m.n_layers, m.n_layers + m.mtp_layers)
    with torch.device("meta"), tensor_sizes():
        shell = Transformer(cfg, vocab_size, layers=[])
        total, active = _count(shell, shell.named_parameters(remove_duplicate=False), cfg)
        mtp_total = mtp_active = 0
        for moe_layer in (False, True):
            n_main, n_mtp = _blocks_of_kind(cfg, main, moe_layer), _blocks_of_kind(cfg, mtp, moe_layer)
            if n_main + n_mtp == 0:
                continue
            block = _block_of_kind(cfg, moe_layer)
            block_total, block_active = _count(block, block.named_parameters(), cfg)
            total, active = total + n_main * block_total, active + n_main * block_active
            if n_mtp:
                module = MTPModule(block, m.dim, m.norm_eps)
                module_total, module_active = _count(module, module.named_parameters(), cfg)
                mtp_total, mtp_active = mtp_total + n_mtp * module_total, mtp_active + n_mtp * module_active
    return ParamCounts(total=total + mtp_total, active=active + mtp_active,
                       embedding=shell.tok_embeddings.weight.numel(), tied=m.tie_embeddings,
                       mtp=mtp_total, mtp_active=mtp_active)


@contextlib.contextmanager
def tensor_sizes():
    """A weight of more elements than torch can count (2^63, sizes each within int64) is a
    ConfigError, not torch's RuntimeError: no device, not even meta, can make it."""
    try:
        yield
    except RuntimeError as e:
        if "overflow" not in str(e):
            raise
        raise ConfigError(f"a weight of this model would hold more elements than a tensor can (torch: "
                          f"{str(e).splitlines()[0]}); make model.dim, model.ffn_hidden, moe.expert_hidden or "
                          "the vocabulary smaller") from None


def _blocks_of_kind(cfg, blocks: range, moe_layer: bool) -> int:
    """How many of the layer ids `blocks` are MoE (dense) layers."""
    from moefold.models.transformer import moe_layers_in

    n_moe = moe_layers_in(cfg, blocks)
    return n_moe if moe_layer else len(blocks) - n_moe


def _block_of_kind(cfg, moe_layer: bool) -> nn.Module:
    """The block `build_model` makes for a dense (MoE) layer: layer 0 of a config whose pattern
    makes layer 0 one (a block's parameters depend on its kind, not on its id)."""
    from moefold.models.transformer import _build_block

    pattern = {"first_k_dense": 0, "moe_every": 1, "dense_layers": []} if moe_layer else {"first_k_dense": 1}
    return _build_block(replace(cfg, moe=replace(cfg.moe, **pattern)), 0, "cpu", torch.float32, None)


def describe_params(cfg) -> str:
    """Parameter counts as model cards give them (embedding and head included), and the count the
    FLOP convention uses (embedding lookup excluded)."""
    from moefold.data.tokenizer import model_vocab_size

    vocab_size = model_vocab_size(cfg)
    c = config_param_counts(cfg, vocab_size)
    flops = _train_flops_per_token(cfg, c.active, vocab_size * cfg.model.dim, cfg.train.seq_len)
    lines = [f"total parameters:  {in_units(c.main_total)} (embedding and output head included)",
             f"active per token:  {in_units(c.main_active)} (embedding and output head included; "
             f"routed experts count top_k/num_experts)"]
    if c.mtp:
        lines.append(f"MTP modules:       {in_units(c.mtp)} more, {in_units(c.mtp_active)} active "
                     f"(not in the figures above)")
    mtp = ", MTP modules included" if c.mtp else ""
    per_token = f"{flops / 1e9:.2f} GFLOP" if flops >= 1e9 else f"{flops / 1e6:.2f} MFLOP"
    lines.append(f"FLOP convention:   {in_units(c.active)} active without the embedding lookup{mtp}; "
                 f"{per_token} per token at sequence {cfg.train.seq_len} (fwd+bwd)")
    return "\n".join(lines)


def in_units(n: int) -> str:
    """A parameter count as model cards write it: 671.026B, 2.82M (a tiny model read 0.003B)."""
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
