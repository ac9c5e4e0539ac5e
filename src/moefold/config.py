"""Typed run configuration: one dataclass per concern, TOML presets, dotted overrides, validation.

The docstring under each field is its CLI help (`moefold train --help`). A config is built in one
place, `load_config`: preset (name or path) → TOML overrides → CLI overrides → `validate`. Invalid
values fail there, before any work starts, with a message naming the field, the value and what is
allowed. A run's saved config.toml is read by `read_run_config`, which drops the options of the
file an older moefold saved where they have no effect (refused since).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import math
import tomllib
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from moefold.errors import ConfigError


@dataclass
class ModelConfig:
    family: str = "qwen3_moe"
    """Hugging Face architecture of the model: qwen3_moe, deepseek_v3 or mixtral (these convert to
    and from Hugging Face checkpoints), deepseek_v2 or olmoe (shapes only, no conversion yet). The
    tiny default is a Qwen3-MoE."""
    vocab_size: int = 0
    """Vocabulary size; 0 takes the tokenizer's."""
    dim: int = 128
    """Model (hidden) dimension D."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Query heads."""
    n_kv_heads: int = 0
    """Key/value heads for grouped-query attention; 0 means n_heads (plain multi-head)."""
    head_dim: int = 0
    """Dimension of one head; 0 means dim // n_heads."""
    ffn_hidden: int = 512
    """Hidden size of the dense SwiGLU MLP (dense layers only)."""
    qk_norm: bool = True
    """RMSNorm on each query and key head before RoPE (Qwen3); GQA only (set false for MLA)."""
    attention: str = "gqa"
    """Attention: gqa (grouped-query, Qwen3/Mixtral) or mla (multi-head latent, DeepSeek-V2/V3)."""
    sliding_window: int = 0
    """Each token attends to at most this many latest tokens (Mixtral); 0 is full causal attention."""
    q_lora_rank: int = 0
    """MLA: rank of the query compression; 0 projects queries directly."""
    kv_lora_rank: int = 512
    """MLA: rank of the shared key/value latent."""
    qk_nope_head_dim: int = 128
    """MLA: per-head query/key dims without RoPE."""
    qk_rope_head_dim: int = 64
    """MLA: per-head query/key dims with (decoupled) RoPE."""
    v_head_dim: int = 128
    """MLA: per-head value dims."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_interleaved: bool = False
    """MLA: RoPE dims stored interleaved and de-interleaved before rotation (DeepSeek-V3 checkpoints)."""
    rope_scaling: str = "none"
    """RoPE scaling for long context: none or yarn."""
    rope_factor: float = 1.0
    """YaRN: context extension factor."""
    rope_original_max_len: int = 4096
    """YaRN: the context length the model was pre-trained with."""
    yarn_beta_fast: float = 32.0
    """YaRN: high-frequency boundary (rotations)."""
    yarn_beta_slow: float = 1.0
    """YaRN: low-frequency boundary (rotations)."""
    yarn_mscale: float = 1.0
    """YaRN: magnitude scale of the RoPE tables."""
    yarn_mscale_all_dim: float = 0.0
    """YaRN: magnitude scale applied to the attention softmax (DeepSeek: mscale²)."""
    yarn_truncate: bool = True
    """YaRN: round the ends of the ramp between kept and interpolated frequencies to whole dims
    (the paper's, DeepSeek's); false keeps them fractional (gpt-oss: rope_parameters.truncate)."""
    mtp_layers: int = 0
    """Multi-token prediction modules (DeepSeek-V3): module k predicts token t+k+1."""
    mtp_loss_weight: float = 0.3
    """Weight of the mean multi-token-prediction loss added to the main loss."""
    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    tie_embeddings: bool = False
    """Share the input embedding with the output head."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""
    max_position_embeddings: int = 0
    """The context length a Hugging Face export states (config.json's max_position_embeddings, kept
    from an imported checkpoint); 0: YaRN's extended length, else max(train.seq_len, 4096)."""
    eos_token_ids: list[int] = field(default_factory=list)
    """config.json's eos_token_id of an imported checkpoint (one id or several), kept for its
    export; without a generation_config.json, where generate stops besides the end-of-document id."""
    generation_eos_token_ids: list[int] = field(default_factory=list)
    """generation_config.json's eos_token_id of an imported checkpoint (Qwen3 instruct's <|im_end|>
    and <|endoftext|>): where its generate stops besides the end-of-document id; exported again."""
    generation_config: str = ""
    """An imported checkpoint's generation_config.json as JSON, less eos_token_id (above) and
    transformers_version: its sampling defaults, written back by the export ("": it had none, and
    generate stops at config.json's eos ids; "{}": one without eos ids stops at none of them)."""
    bos_token_ids: list[int] = field(default_factory=list)
    """config.json's bos_token_id of an imported checkpoint ([] for null), written back by the export."""
    pad_token_ids: list[int] = field(default_factory=list)
    """config.json's pad_token_id of an imported checkpoint ([] for null), written back by the export."""

    def stated_context(self) -> tuple[int, str] | None:
        """The context the model states, and the options that set it: max_position_embeddings,
        else YaRN's extended length; None for neither (what it means then is the reader's: an
        export states max(train.seq_len, 4096), generate reads train.seq_len)."""
        if self.max_position_embeddings:
            return self.max_position_embeddings, "model.max_position_embeddings"
        if self.rope_scaling == "yarn":
            length = int(self.rope_original_max_len * self.rope_factor)
            return length, "model.rope_original_max_len × model.rope_factor"
        return None


@dataclass
class MoEConfig:
    num_experts: int = 8
    """Routed experts per MoE layer (0 makes every layer dense)."""
    top_k: int = 2
    """Experts each token is sent to."""
    expert_hidden: int = 256
    """Hidden size F of one routed expert's MLP."""
    first_k_dense: int = 1
    """The first k layers use the dense MLP."""
    moe_every: int = 1
    """After the first_k_dense layers, every n-th layer is an MoE layer (the rest dense)."""
    dense_layers: list[int] = field(default_factory=list)
    """Further layers that use the dense MLP (Qwen3's mlp_only_layers)."""

    # Router
    score_func: str = "softmax"
    """Router score function: softmax (Mixtral, Qwen3) or sigmoid (DeepSeek-V3)."""
    router_dtype: str = "fp32"
    """Precision of the router logits and scores: fp32 or fp64."""
    softmax_before_topk: bool = True
    """softmax over all experts, then top-k (Qwen3, DeepSeek); false: top-k of the logits, then
    softmax over the K chosen (Mixtral). Only for score_func=softmax."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing probabilities to sum to 1."""
    routed_scaling_factor: float = 1.0
    """Multiplier of the routing probabilities (DeepSeek-V3: 2.5)."""
    num_groups: int = 0
    """Group-limited routing: experts split into this many groups (0 or 1: no groups)."""
    group_top_k: int = 0
    """Group-limited routing: groups each token may choose from; a group scores by the sum of its
    top group_score_top_k experts."""
    group_score_top_k: int = 0
    """Group-limited routing: experts summed for a group's score; 0 means top_k // group_top_k
    (Megatron). DeepSeek-V3 checkpoints use 2."""
    input_jitter: float = 0.0
    """Multiply the router input by uniform noise in [1-eps, 1+eps] during training (0: off); the
    experts read the input unjittered (Megatron's moe_input_jitter_eps)."""
    z_loss_coeff: float = 0.0
    """Weight of the router z-loss, mean(logsumexp(logits)²) (ST-MoE); 0 disables it."""

    # Load balancing
    aux_loss_coeff: float = 0.01
    """Weight of the micro-batch load-balancing loss (Switch Transformer's, its f_e counting all K
    routed copies of a token as Megatron-Core's does, not GShard's first choices only); 0 disables it."""
    seq_aux_loss_coeff: float = 0.0
    """Weight of the sequence-level load-balancing loss (DeepSeek-V2/V3); 0 disables it."""
    global_aux_loss_coeff: float = 0.0
    """Weight of the global-batch load-balancing loss (token counts accumulated over the
    micro-batches of an optimizer step); 0 disables it."""
    expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias added to the scores for selection only."""
    expert_bias_update_rate: float = 1e-3
    """Expert-bias step: bias += rate * sign(mean count - count), once per optimizer step."""
    force_balanced: bool = False
    """Ignore the router's choice and send tokens round-robin to experts (for benchmarks). An off
    switch of the choice, as num_experts=0 is of the MoE layers: a preset's expert_bias (updated
    and saved, never read) and group-limited routing (num_groups) stay accepted, unread, so a real
    config benchmarks as it is; the router's scores still weigh the chosen experts and feed the
    aux losses and z-loss."""

    # Capacity
    capacity_factor: float = 0.0
    """Per-expert capacity as a multiple of the even share T*K/E of a rank's own T tokens (each rank
    drops its own copies, with or without EP); 0 is dropless. `moefold generate` is always dropless."""
    drop_policy: str = "probs"
    """Which tokens an over-capacity expert drops: probs (lowest probability) or position (latest)."""
    pad_to_capacity: bool = False
    """With a capacity factor: pad every expert to exactly its capacity (static shapes; under EP no
    host sync, with parallel.ep_dispatcher=alltoall and the same tokens on every rank)."""

    # Permutation and experts
    pad_multiple: int = 0
    """Pad each expert's rows to a multiple of this (0, 8, 16, 32, 64 or 128) for low-precision GEMMs."""
    memory_efficient_permute: bool = True
    """Apply routing probabilities inside the expert activation, so the down-projection output is
    not kept for backward."""
    activation: str = "swiglu"
    """Expert and shared-expert MLP activation: swiglu, gelu or relu2 (squared ReLU)."""
    shared_experts: int = 0
    """Shared experts every token passes through (fused into one MLP)."""
    shared_expert_hidden: int = 0
    """Hidden size of one shared expert; 0 means expert_hidden."""
    shared_expert_gate: bool = False
    """Scale the shared experts' output by a learned sigmoid gate (Qwen2-MoE)."""
    experts_backend: str = "auto"
    """How the experts' GEMMs run: grouped_mm (torch._grouped_mm), loop (one matmul per expert) or
    auto (grouped_mm where this torch build supports it and the experts' rows are 16-byte aligned,
    else loop)."""


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size for attention, dense MLPs and shared experts; routed experts get the
    tokens split along the sequence over these ranks."""
    cp: int = 1
    """Context-parallel size (training with cp > 1 is not yet supported; the planner takes it)."""
    pp: int = 1
    """Pipeline-parallel size (training with pp > 1 is not yet supported; the planner takes it)."""
    vpp: int = 1
    """Virtual pipeline stages per pp rank (interleaved schedule); used by the memory planner."""
    ep: int = 1
    """Expert-parallel size: each EP rank holds moe.num_experts / ep experts."""
    etp: int = 1
    """Expert tensor-parallel size: each expert's hidden dimension is split over etp ranks."""
    order: str = "tp-cp-ep-dp-pp"
    """Rank order both layouts are built from, fastest-varying first (Megatron-Core's order): the
    attention grid (pp, dp, cp, tp) reads it with ep=1, the expert grid (pp, edp, ep, etp) with
    cp=1, tp as etp and dp as edp. Keep pp last so a pipeline stage holds the same ranks in both."""
    data_parallel: str = "fsdp"
    """Data parallelism over dp·cp (dense) and edp (experts): fsdp (FSDP2: parameters, gradients
    and optimizer states sharded) or ddp (ZeRO-1: parameters replicated, gradients reduce-scattered,
    optimizer states sharded)."""
    sequence_parallel: bool = True
    """With tp > 1, shard the residual stream and norms along the sequence between the TP regions
    (Megatron's sequence parallelism): 1/tp of their activation memory."""
    ep_dispatcher: str = "alltoall"
    """How routed tokens reach their experts under ep/etp > 1: alltoall (token all-to-all, one
    device→host copy of split sizes per layer) or allgather (gather all tokens, no host sync)."""

    @property
    def shards_sequence(self) -> bool:
        """Whether the main blocks run on sequence shards: sequence_parallel, with tp > 1."""
        return self.sequence_parallel and self.tp > 1


@dataclass
class TrainConfig:
    steps: int = 300
    """Optimizer steps to train for."""
    micro_batch_size: int = 16
    """Sequences per micro-batch."""
    seq_len: int = 256
    """Tokens per sequence."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step (per data-parallel rank)."""
    global_batch_size: int = 0
    """Sequences per optimizer step over all ranks; 0 means micro_batch_size · dp · grad_accum.
    When set, grad_accum is derived from it (it must divide by micro_batch_size · dp)."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr (cosine, wsd). Where no step decays (train.steps <=
    max(warmup_steps, 1)) it changes nothing, yet is accepted: a short smoke test of a real config
    keeps it, and a resume with more train.steps decays to it."""
    schedule: str = "cosine"
    """Learning-rate schedule after warm-up: cosine, wsd (warmup-stable-decay, linear decay) or
    constant."""
    warmup_steps: int = 30
    """Linear warm-up steps."""
    decay_fraction: float = 0.2
    """For the wsd schedule: the fraction of steps spent in the final decay. Accepted as
    min_lr_ratio is where at most the last step decays (train.steps <= max(warmup_steps + 1, 2)),
    though it changes nothing there."""
    weight_decay: float = 0.1
    """AdamW weight decay (not applied to norms, biases or embeddings)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    loss_chunk_tokens: int = 0
    """Tokens per chunk of the fused output head + cross-entropy, which never holds the whole
    [tokens, vocabulary] logits (0: the plain head and loss); the MTP depths' heads too."""
    compile: bool = False
    """torch.compile each transformer block (regional compilation; train/compile.py). For GPUs:
    on the CPU Inductor needs a C++ compiler."""
    seed: int = 0
    """Seed for initialisation and data order."""
    device: str = "auto"
    """Where to train: auto (cuda when available, else cpu), cpu or cuda."""
    val_every: int = 100
    """Compute the validation loss every N steps (and at the end); 0 only at the end."""
    val_batches: int = 8
    """Micro-batches of micro_batch_size sequences in one validation pass: the first val_batches ·
    micro_batch_size validation sequences, the same on any layout (data ranks share them)."""


@dataclass
class OptimConfig:
    exp_avg_dtype: str = "fp32"
    """AdamW first-moment storage: fp32, bf16 or fp8 (e4m3 with per-128-element scales)."""
    exp_avg_sq_dtype: str = "fp32"
    """AdamW second-moment storage: fp32, bf16 or fp8 (e4m3 of sqrt(v), per-block scales)."""
    master_dtype: str = "fp32"
    """Master weights: fp32, bf16 (the bf16 parameters are the master) or bf16+remainder (bf16
    parameters plus int16 remainders that rebuild the fp32 value exactly)."""
    grad_dtype: str = "fp32"
    """Gradients: fp32 or bf16 (reduced over the data ranks in that dtype, and rounded to it before
    every optimizer step, also in one process). A gradient has its parameter's dtype, so with a bf16
    master (master_dtype bf16 or bf16+remainder) they are bf16 and reduced in bf16 either way."""


# Names of `memory.recompute` and `memory.offload` (memory/sites.py says where each lives).
MEMORY_MODULES = ("norm", "attn_core", "mla_up_proj", "moe_act", "shared_experts", "mlp", "moe", "layer")


@dataclass
class MemoryConfig:
    recompute: list[str] = field(default_factory=list)
    """Activations to recompute in backward instead of keeping, any of: norm (block pre-norms, freed
    once the next layer saved them, and QK-norms), attn_core (softmax(QK^T)V), mla_up_proj (MLA's
    per-head q/k/v from the latents), moe_act (routed experts' activation), shared_experts, mlp
    (dense MLP), moe (whole MoE layer, routing replayed) or layer (whole block). Results are
    unchanged; see docs/recompute_offload.md."""
    offload: list[str] = field(default_factory=list)
    """Modules (same names as memory.recompute) whose saved activations move to host memory during
    forward (pinned, on a side stream on CUDA) and back before backward needs them."""
    offload_min_bytes: int = 1048576
    """Only saved tensors on a storage of at least this many bytes are offloaded (the storage is
    what moves); parameters never are."""


@dataclass
class DataConfig:
    path: str = ""
    """Training data: a .txt/.jsonl/.parquet/.npy/.bin file or a directory of them; empty uses the
    embedded corpus (the running Python's standard library sources). A .txt file is one document
    (for many, split a corpus into files, or use .jsonl with one document per line)."""
    tokenizer: str = ""
    """A Hugging Face tokenizer.json; empty uses the byte-level tokenizer (256 bytes + end-of-document)."""
    val_fraction: float = 0.02
    """Fraction of documents held out for validation (fixed by document name, not by seed); token
    files and a single text document (one .txt file) hold out their last tokens instead."""
    text_field: str = "text"
    """Field holding the text in .jsonl and .parquet files."""
    token_dtype: str = "uint16"
    """Element type of pre-tokenized .bin files: uint16 or uint32. A .bin file has no header to
    check it against: uint32 ids read as uint16 are refused (every second one is 0), uint16 ids
    read as uint32 are other ids (only those beyond the vocabulary are caught); .npy files carry
    their dtype."""
    eos_id: int = -1
    """End-of-document token id in pre-tokenized files (.npy, .bin); -1 takes the tokenizer's. Text
    data always takes the tokenizer's (another value is refused). Token files are joined as they
    are, with no EOS inserted between them: end (or start) each file's documents with it."""


@dataclass
class PrecisionConfig:
    compute_dtype: str = "auto"
    """Compute precision: auto (bf16 autocast on GPU, fp32 on CPU), bf16 or fp32. Parameters and
    optimizer states stay fp32."""
    fp8: str = "off"
    """FP8 (e4m3) GEMMs for the attention/MLP linears and the routed experts: off, tensorwise, rowwise
    or blockwise (DeepSeek-V3: 1x128 activations, 128x128 weights). Router, embeddings, output head,
    norms and attention core stay in high precision; see docs/fp8.md."""
    fp8_exclude: list[str] = field(default_factory=list)
    """Module names kept in high precision, as fnmatch patterns over the model's module names, e.g.
    ["layers.0.*", "*.attn.*"]."""
    fp8_bf16_first_layers: int = 0
    """Keep the first N blocks in high precision."""
    fp8_bf16_last_layers: int = 0
    """Keep the last N blocks of the main stack in high precision (MTP blocks follow fp8_exclude)."""
    fp8_grouped_gemm: str = "triton"
    """The routed experts' FP8 grouped GEMM on CUDA: triton (moefold's kernels, fp8/triton_grouped.py;
    faster on the H200) or cutlass (torch._scaled_grouped_mm). Elsewhere the emulation runs either
    way."""
    fp8_weight_grad: str = "fp8"
    """The weight-gradient GEMMs (grad_y^T x) of the FP8 modules: fp8 (the recipe's scaling) or bf16
    (unquantized, in the compute dtype; torchao's rowwise_with_gw_hp). Forward and grad_input stay
    FP8 either way."""
    fp8_saved_activations: bool = False
    """Keep the FP8 GEMMs' inputs for backward in FP8 (the forward's own tiles, 1 byte per element
    plus scales) instead of the compute dtype; the weight gradient then rounds them twice."""
    fp8_weight_cache: bool = False
    """Quantize the routed experts' weights to FP8 once per optimizer step, both layouts their GEMMs
    read kept until the next (2 bytes per expert parameter for the whole run), instead of in every
    micro-batch's forward and backward: faster with train.grad_accum > 1, no gain with one
    micro-batch. Needs precision.fp8; not with FSDP sharding the experts (edp > 1)."""
    fp8_emulate: bool = False
    """Run every FP8 GEMM as its emulation (quantize → dequantize → GEMM in the compute dtype) on
    CUDA too, as it always runs on CPU: the kernels' numerical reference in a real run (torchao's
    `emulate`); slower than bf16."""


@dataclass
class CheckpointConfig:
    every: int = 0
    """Save a checkpoint every N steps; 0 saves only at the end (and on SIGINT/SIGTERM)."""
    keep: int = 2
    """Keep the newest N checkpoints; older ones are deleted after a newer one is complete."""
    save_at_end: bool = True
    """Save a checkpoint when training finishes."""


@dataclass
class LoggingConfig:
    log_every: int = 10
    """Print and record metrics every N steps."""
    progress_bar: bool = True
    """Show a progress bar (only on a terminal)."""
    tensorboard: bool = True
    """Also write TensorBoard events to <run_dir>/tb when tensorboard is installed."""
    expert_load_heatmap: bool = True
    """At the end of a run, write <run_dir>/expert_load.png (tokens per expert per MoE layer over the
    log steps) when matplotlib is installed."""
    peak_tflops: float = 0.0
    """Peak dense bf16 TFLOP/s of one device for MFU; 0 looks the GPU up (H100/H200: 989), none on CPU."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    data: DataConfig = field(default_factory=DataConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


SECTIONS = tuple(f.name for f in dataclasses.fields(Config))
FAMILIES = ("qwen3_moe", "deepseek_v3", "deepseek_v2", "mixtral", "olmoe")
DEFAULT_PRESET = "tiny"


# ---------------------------------------------------------------------------------------------
# Field introspection: types and docstrings
# ---------------------------------------------------------------------------------------------


def _section_class(section: str) -> type:
    return typing.get_type_hints(Config)[section]


@functools.cache
def field_types() -> dict[str, type]:
    """Every dotted key (`moe.top_k`) mapped to its declared type."""
    types = {}
    for section in SECTIONS:
        for name, tp in typing.get_type_hints(_section_class(section)).items():
            types[f"{section}.{name}"] = tp
    return types


@functools.cache
def field_docs() -> dict[str, str]:
    """Every dotted key mapped to the docstring written under its declaration."""
    docs = {}
    for section in SECTIONS:
        tree = ast.parse(inspect.getsource(_section_class(section)))
        body = tree.body[0].body
        for stmt, nxt in zip(body, body[1:]):
            if isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr):
                if isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                    docs[f"{section}.{stmt.target.id}"] = " ".join(nxt.value.value.split())
    return docs


# ---------------------------------------------------------------------------------------------
# Building a config: presets, TOML tables, dotted overrides
# ---------------------------------------------------------------------------------------------


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("moefold.presets").iterdir()
                  if p.name.endswith(".toml"))


def read_preset(name_or_path: str, label: str | None = None) -> dict[str, Any]:
    """The TOML table of a shipped preset (by name) or of a file (by path). `label` names it in
    errors (default `--config NAME`; a saved run's config.toml is named as the file)."""
    label = label or f"--config {name_or_path}"
    path = Path(name_or_path)
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:  # TOML is UTF-8
            raise ConfigError(f"{label}: not UTF-8 text (byte {e.start}: "
                              f"{e.object[e.start:e.start + 1]!r}); TOML files are UTF-8") from None
        except OSError as e:  # a file without read permission
            raise ConfigError(f"{label}: cannot be read ({e.strerror or e})") from None
    elif name_or_path in preset_names():  # a folder of the preset's name does not hide it
        text = resources.files("moefold.presets").joinpath(f"{name_or_path}.toml").read_text()
    elif path.is_dir():
        raise ConfigError(f"{label}: is a folder; give a TOML file or a preset")
    elif name_or_path.endswith(".toml"):
        raise ConfigError(f"{label}: no such file")
    else:
        close = difflib.get_close_matches(name_or_path, preset_names(), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"{label}: no such preset or file (presets: "
                          f"{', '.join(preset_names())}){hint}")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{label}: invalid TOML: {e}") from None


def _unknown_key(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, list(field_types()), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else ""
    return ConfigError(f"unknown config key {key}{hint}")


def _coerce(key: str, value: Any, from_cli: bool) -> Any:
    """`value` (from TOML or a CLI string) converted to the declared type of `key`."""
    tp = field_types()[key]
    if typing.get_origin(tp) is list:
        return _coerce_list(key, value, typing.get_args(tp)[0], from_cli)
    if from_cli and isinstance(value, str) and tp is not str:  # TOML values carry their own type
        value = _parse_cli_value(key, value, tp)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, tp) and not (tp is int and isinstance(value, bool))
    if not ok:
        raise ConfigError(f"{key}={value!r} is not a valid {tp.__name__}")
    return value


def _coerce_list(key: str, value: Any, item_type: type, from_cli: bool) -> list:
    as_text = from_cli and isinstance(value, str)  # a TOML array in one argument: '["moe", "attn"]'
    example = _list_example(item_type, shell_quoted=as_text)
    if as_text:
        try:
            value = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            raise ConfigError(f"{key}={value!r} is not a list (write it as {example})") from None
    if not isinstance(value, list) or not all(isinstance(v, item_type) and not isinstance(v, bool)
                                              for v in value):
        raise ConfigError(f"{key}={value!r} is not a list of {item_type.__name__} (write it as {example})")
    return list(value)


def _list_example(item_type: type, shell_quoted: bool) -> str:
    """How to write a list option: as TOML in a file, and inside the shell's quotes on a command line."""
    if item_type is not str:
        return "[1, 2]"
    array = """'["a", "b"]'""" if shell_quoted else '["a", "b"]'
    return f"{array}, strings in double quotes"


def _parse_cli_value(key: str, text: str, tp: type) -> Any:
    if tp is bool:
        lowered = text.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}={text!r} is not a valid bool (use true or false)")
    try:
        return tp(text)
    except ValueError:
        raise ConfigError(f"{key}={text!r} is not a valid {tp.__name__}") from None


def apply_overrides(cfg: Config, overrides: dict[str, Any], source: str | None = None) -> None:
    """Set dotted keys (`{"moe.top_k": 4}`) on `cfg`, converting and type-checking each value.

    `source` names the config file the values were read from (its errors name it too); None means
    the command line's strings."""
    for key, value in overrides.items():
        try:
            if key not in field_types():
                raise _unknown_key(key)
            section, name = key.split(".")
            setattr(getattr(cfg, section), name, _coerce(key, value, from_cli=source is None))
        except ConfigError as error:
            if source is None:
                raise
            raise ConfigError(f"{source}: {error}") from None


def flatten_table(table: dict[str, Any], source: str) -> dict[str, Any]:
    """A TOML table `{section: {field: value}}` as dotted keys; a key outside a section is an error."""
    flat = {}
    for section, values in table.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: top-level key {section!r} must be a [section] "
                              f"({', '.join(SECTIONS)})")
        if section not in SECTIONS:
            close = difflib.get_close_matches(section, SECTIONS, n=1)
            hint = f"; did you mean [{close[0]}]?" if close else ""
            raise ConfigError(f"{source}: unknown section [{section}]{hint}")
        for name, value in values.items():
            flat[f"{section}.{name}"] = value
    return flat


def load_config(preset: str | None = None, overrides: dict[str, Any] | None = None,
                label: str | None = None) -> Config:
    """Preset (default `tiny`) + dotted overrides, validated. `label` names the preset in errors
    (default `--config PRESET`)."""
    cfg = Config()
    source = preset or DEFAULT_PRESET
    label = label or f"--config {source}"
    apply_overrides(cfg, flatten_table(read_preset(source, label), label), source=label)
    apply_overrides(cfg, overrides or {})
    validate(cfg)
    return cfg


def config_from_toml(path: Path, overrides: dict[str, Any] | None = None) -> Config:
    """The config a run saved (`<run_dir>/config.toml`), with overrides, validated; its errors name
    the file (a --resume or --run-dir gave it, never --config). `read_run_config` says what it drops."""
    return read_run_config(path, overrides)[0]


def read_run_config(path: Path, overrides: dict[str, Any] | None = None,
                    text: str | None = None) -> tuple[Config, list[str]]:
    """`config_from_toml`, and a note for each option of the file it dropped: one without effect
    in the config with the overrides, which an older moefold accepted and saved (refused since):
    the run must still resume (or generate) without it (`InertOptionError.unset`). One the
    overrides give is refused, as in a fresh run. `text`: the TOML itself where `path` holds it
    as a value (the config a checkpoint was saved with); `path` then only names it."""
    label, overrides = str(path), overrides or {}
    cfg = Config()
    table = read_preset(label, label) if text is None else tomllib.loads(text)
    apply_overrides(cfg, flatten_table(table, label), source=label)
    apply_overrides(cfg, overrides)
    notes, set_to = [], set()
    while True:  # one error at a time: each drop lets validate reach the next
        try:
            validate(cfg)
            return cfg, notes
        except InertOptionError as error:
            if error.key in overrides or (error.key, repr(error.unset)) in set_to:  # never loop
                raise
            set_to.add((error.key, repr(error.unset)))  # a list option may lose one name, then another
            section, name = error.key.split(".")
            setattr(getattr(cfg, section), name, error.unset)
            notes.append(f"note: {label}: {error}; the resumed run drops it")


# ---------------------------------------------------------------------------------------------
# TOML output
# ---------------------------------------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):  # TOML's basic strings take no control character but tab: \uXXXX
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return '"' + "".join(f"\\u{ord(c):04x}" if ord(c) < 0x20 and c != "\t" or c == "\x7f" else c
                             for c in escaped) + '"'
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return str(value)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML that `load_config` reads back to an equal config."""
    lines = []
    for section in SECTIONS:
        lines.append(f"[{section}]")
        for f in dataclasses.fields(getattr(cfg, section)):
            lines.append(f"{f.name} = {_toml_value(getattr(getattr(cfg, section), f.name))}")
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


class InertOptionError(ConfigError):
    """`key` is set where the rest of the config leaves it without effect; at `unset` it has none.
    Refused as any error, except in a run's saved config.toml (`read_run_config`)."""

    def __init__(self, message: str, key: str, unset: Any):
        super().__init__(message)
        self.key, self.unset = key, unset


_DEFAULT = object()


def _require_effect(ok: bool, key: str, message: str, unset: Any = _DEFAULT) -> None:
    """`_require` for an option that would change nothing here: `unset` (default: the field's
    default) is the value at which it has no effect either and is not refused."""
    if not ok:
        section, name = key.split(".")
        default = getattr(_section_class(section)(), name)
        raise InertOptionError(message, key, default if unset is _DEFAULT else unset)


def _value(cfg: Config, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _positive(cfg: Config, *keys: str) -> None:
    for key in keys:
        value = _value(cfg, key)
        _require(value > 0, f"{key}={value} must be > 0")


def _non_negative(cfg: Config, *keys: str) -> None:
    for key in keys:
        value = _value(cfg, key)
        _require(value >= 0, f"{key}={value} must be >= 0")


def _finite(cfg: Config) -> None:
    """No option means anything at nan or ±inf (TOML and float() both accept them), nor at an
    integer beyond 64 bits (Python's are unbounded; torch's sizes, counts and seeds are int64)."""
    for key, tp in field_types().items():
        _require_finite(key, tp, _value(cfg, key))


def _require_finite(key: str, tp: type, value: Any) -> None:
    if tp is float:
        _require(math.isfinite(value), f"{key}={value} must be a finite number")
    elif tp is int:
        bound = "< 2**63" if value >= 0 else ">= -2**63"
        _require(-2**63 <= value < 2**63, f"{key}={value} must be {bound} (a 64-bit integer)")


def _shown(value: Any) -> str:
    """A value as the messages write it: bools as in TOML, strings and lists as Python's repr."""
    return _toml_value(value) if isinstance(value, bool) else repr(value)


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    _require(value in allowed, f"{key}={value!r} is not one of {', '.join(allowed)}")


# fp32's smallest normal number, 2**-126: a smaller AdamW eps is 0 (or a subnormal that GPU
# kernels flush to 0) in the optimizer's arithmetic, and a parameter without gradient then gets 0/0.
FP32_SMALLEST_NORMAL = 2.0**-126


def micro_batches_per_step(t: TrainConfig, dp: int) -> int:
    """Micro-batches per optimizer step on each data rank: train.grad_accum, or what
    train.global_batch_size leaves after micro_batch_size · dp (the trainer and the planner)."""
    if not t.global_batch_size:
        return t.grad_accum
    per_micro_step = t.micro_batch_size * dp
    if t.global_batch_size % per_micro_step:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} is not divisible by "
                          f"train.micro_batch_size · dp = {t.micro_batch_size} · {dp}")
    return t.global_batch_size // per_micro_step


def validate(cfg: Config) -> None:
    """Raise ConfigError for the first invalid value, naming the field, the value and the rule."""
    _finite(cfg)
    m, moe, t = cfg.model, cfg.moe, cfg.train
    _positive(cfg, "model.dim", "model.n_layers", "model.n_heads", "model.ffn_hidden",
              "model.rope_theta", "model.norm_eps", "model.init_std",
              "moe.top_k", "moe.expert_hidden", "moe.moe_every",
              "train.steps", "train.micro_batch_size", "train.seq_len", "train.grad_accum",
              "train.lr", "train.val_batches", "logging.log_every", "checkpoint.keep")
    _non_negative(cfg, "model.vocab_size", "model.n_kv_heads", "model.head_dim", "model.max_position_embeddings",
                  "moe.num_experts", "moe.first_k_dense", "train.warmup_steps", "train.global_batch_size",
                  "train.weight_decay", "train.grad_clip", "train.loss_chunk_tokens", "train.val_every", "train.seed",
                  "checkpoint.every", "logging.peak_tflops")
    blocks = m.n_layers + m.mtp_layers  # int64 each, not together (the layer checks count ranges of them)
    _require(blocks < 2**63, f"model.n_layers + model.mtp_layers = {blocks} must be < 2**63 (a 64-bit integer)")
    if m.attention == "gqa":  # MLA's heads have their own sizes (model.qk_*_head_dim, v_head_dim)
        n_kv = m.n_kv_heads or m.n_heads
        _require(m.n_heads % n_kv == 0,
                 f"model.n_heads={m.n_heads} must be a multiple of model.n_kv_heads={n_kv}")
        _require(m.head_dim or m.dim % m.n_heads == 0,
                 f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}; set model.head_dim")
        head_dim = m.head_dim or m.dim // m.n_heads
        _require(head_dim % 2 == 0, f"model.head_dim={head_dim} must be even for RoPE")
    validate_moe(moe)
    _validate_drop_policy(moe)
    layers = m.n_layers + m.mtp_layers
    _require(all(0 <= i < layers for i in moe.dense_layers),
             f"moe.dense_layers={moe.dense_layers} names a layer that does not exist; allowed: 0 to "
             f"{layers - 1} (model.n_layers + model.mtp_layers)")
    _require(0.0 <= t.min_lr_ratio <= 1.0, f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]")
    _one_of("train.schedule", t.schedule, ("cosine", "wsd", "constant"))
    _require(0.0 < t.decay_fraction <= 1.0,
             f"train.decay_fraction={t.decay_fraction} must be in (0, 1]")
    # optim/schedule.py: only wsd reads the decay fraction, and constant never decays to the minimum
    _require_effect(t.schedule == "wsd" or t.decay_fraction == TrainConfig.decay_fraction, "train.decay_fraction",
             f"train.decay_fraction={t.decay_fraction} needs train.schedule='wsd'")
    _require_effect(t.schedule != "constant" or t.min_lr_ratio == TrainConfig.min_lr_ratio, "train.min_lr_ratio",
             f"train.min_lr_ratio={t.min_lr_ratio} needs train.schedule 'cosine' or 'wsd' (the constant "
             "schedule never decays)")
    _require(t.seed < 2**63, f"train.seed={t.seed} must be < 2**63 (torch's seeds are 64-bit)")
    _require(not (t.global_batch_size and t.grad_accum != 1),
             f"train.grad_accum={t.grad_accum} and train.global_batch_size={t.global_batch_size}: give one "
             "(global_batch_size sets grad_accum to global_batch_size / (micro_batch_size · dp))")
    _require(t.warmup_steps <= t.steps,
             f"train.warmup_steps={t.warmup_steps} exceeds train.steps={t.steps}")
    _require(0.0 <= t.beta1 < 1.0, f"train.beta1={t.beta1} must be in [0, 1)")
    _require(0.0 <= t.beta2 < 1.0, f"train.beta2={t.beta2} must be in [0, 1)")
    _require(t.eps >= FP32_SMALLEST_NORMAL, f"train.eps={t.eps} must be >= {FP32_SMALLEST_NORMAL:.2g} (fp32's "
             "smallest normal number: the optimizer's fp32 arithmetic makes a smaller one 0)")
    _require(t.lr * t.weight_decay < 1,
             f"train.lr={t.lr} · train.weight_decay={t.weight_decay} = {t.lr * t.weight_decay:g} must be < 1 "
             "(AdamW's decay multiplies each weight by 1 − lr · weight_decay a step: 0 or less zeroes it or "
             "flips its sign)")
    _one_of("train.device", t.device, ("auto", "cpu", "cuda"))
    _require(0.0 <= cfg.data.val_fraction < 1.0,
             f"data.val_fraction={cfg.data.val_fraction} must be in [0, 1)")
    _one_of("data.token_dtype", cfg.data.token_dtype, ("uint16", "uint32"))
    if not cfg.data.path:  # the embedded corpus: plain text, no field to read, no token file
        for key in ("text_field", "token_dtype"):
            value = getattr(cfg.data, key)
            _require_effect(value == getattr(DataConfig, key), f"data.{key}",
                            f"data.{key}={value!r} needs data.path (the embedded corpus is plain text)")
    _require(cfg.data.eos_id >= -1, f"data.eos_id={cfg.data.eos_id} must be >= -1")
    _one_of("precision.compute_dtype", cfg.precision.compute_dtype, ("auto", "bf16", "fp32"))
    _validate_precision(cfg)
    _one_of("optim.exp_avg_dtype", cfg.optim.exp_avg_dtype, ("fp32", "bf16", "fp8"))
    _one_of("optim.exp_avg_sq_dtype", cfg.optim.exp_avg_sq_dtype, ("fp32", "bf16", "fp8"))
    _one_of("optim.master_dtype", cfg.optim.master_dtype, ("fp32", "bf16", "bf16+remainder"))
    _one_of("optim.grad_dtype", cfg.optim.grad_dtype, ("fp32", "bf16"))
    _validate_model(m)
    _validate_parallel(cfg)
    _validate_memory(cfg)


def _validate_model(m: ModelConfig) -> None:
    _one_of("model.family", m.family, FAMILIES)
    _one_of("model.attention", m.attention, ("gqa", "mla"))
    _one_of("model.rope_scaling", m.rope_scaling, ("none", "yarn"))
    for key in ("sliding_window", "q_lora_rank", "mtp_layers", "mtp_loss_weight"):
        _require(getattr(m, key) >= 0, f"model.{key}={getattr(m, key)} must be >= 0")
    _require_effect(m.mtp_layers > 0 or m.mtp_loss_weight == ModelConfig.mtp_loss_weight, "model.mtp_loss_weight",
             f"model.mtp_loss_weight={m.mtp_loss_weight} needs model.mtp_layers > 0 (no MTP loss to weigh)")
    # Weighed 0, the MTP loss has no gradient: the modules cost their forward and backward for nothing.
    _require(m.mtp_layers == 0 or m.mtp_loss_weight > 0,
             f"model.mtp_loss_weight={m.mtp_loss_weight} with model.mtp_layers={m.mtp_layers} trains the MTP "
             "modules on nothing; set model.mtp_layers=0")
    if m.attention == "mla":
        for key in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            _require(getattr(m, key) > 0, f"model.{key}={getattr(m, key)} must be > 0 for MLA")
        _require(m.qk_nope_head_dim >= 0, f"model.qk_nope_head_dim={m.qk_nope_head_dim} must be >= 0")
        _require(m.qk_rope_head_dim % 2 == 0,
                 f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be even for RoPE")
        _require_effect(m.sliding_window == 0, "model.sliding_window",
                        "model.sliding_window needs model.attention='gqa'")
        for key in ("n_kv_heads", "head_dim"):  # MLA's heads are qk_*_head_dim wide, every head its own kv
            _require_effect(getattr(m, key) == 0, f"model.{key}",
                            f"model.{key}={getattr(m, key)} needs model.attention='gqa' "
                     "(MLA sizes its heads with model.qk_nope_head_dim, qk_rope_head_dim and v_head_dim)")
        # MLA normalises its latents (q_norm, kv_norm), never per head: qk_norm would change nothing.
        _require_effect(not m.qk_norm, "model.qk_norm", "model.qk_norm=true needs model.attention='gqa' (MLA has no "
                        "per-head QK-norm)", unset=False)
    else:  # GQA has no query latent and rotates half-split dims: MLA's options would change nothing
        _require_effect(m.q_lora_rank == 0, "model.q_lora_rank",
                        f"model.q_lora_rank={m.q_lora_rank} needs model.attention='mla'")
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _require_effect(getattr(m, key) == getattr(ModelConfig, key), f"model.{key}",
                            f"model.{key}={getattr(m, key)} needs model.attention='mla' "
                            "(GQA's heads are model.head_dim wide)")
        _require_effect(not m.rope_interleaved, "model.rope_interleaved",
                        "model.rope_interleaved=true needs model.attention='mla'")
    if m.rope_scaling != "yarn":
        _require_effect(m.rope_factor == 1, "model.rope_factor",
                        f"model.rope_factor={m.rope_factor} needs model.rope_scaling='yarn'")
        for key in ("rope_original_max_len", "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim",
                    "yarn_truncate"):
            # plain RoPE reads none of YaRN's options
            _require_effect(getattr(m, key) == getattr(ModelConfig, key), f"model.{key}",
                            f"model.{key}={getattr(m, key)} needs model.rope_scaling='yarn'")
        # Pair i turns rope_theta^(-2i/head_dim) rad a token: at <= 1 the slow pairs are the fast
        # ones, and below fp32's range the rate is inf and the first step nan.
        _require(m.rope_theta > 1, f"model.rope_theta={m.rope_theta} must be > 1 (RoPE's base; models use 1e4 to 1e6)")
    else:
        _require(m.rope_factor >= 1, f"model.rope_factor={m.rope_factor} must be >= 1")
        _require(m.rope_original_max_len > 0,
                 f"model.rope_original_max_len={m.rope_original_max_len} must be > 0")
        _require(m.rope_theta > 1, f"model.rope_theta={m.rope_theta} must be > 1 for YaRN")
        for key in ("yarn_beta_fast", "yarn_beta_slow"):  # rotations: their logarithm is taken
            _require(getattr(m, key) > 0, f"model.{key}={getattr(m, key)} must be > 0")
        # Reversed, the ramp interpolates the fastest dims and keeps the slowest: YaRN's opposite.
        _require(m.yarn_beta_fast >= m.yarn_beta_slow, f"model.yarn_beta_fast={m.yarn_beta_fast} must be >= "
                 f"model.yarn_beta_slow={m.yarn_beta_slow} (dims faster than beta_fast keep their frequency, "
                 "dims slower than beta_slow are interpolated)")
        for key in ("yarn_mscale", "yarn_mscale_all_dim"):
            _require(getattr(m, key) >= 0, f"model.{key}={getattr(m, key)} must be >= 0")


FP8_RECIPES = ("off", "tensorwise", "rowwise", "blockwise")


def _validate_precision(cfg: Config) -> None:
    p = cfg.precision
    _one_of("precision.fp8", p.fp8, FP8_RECIPES)
    _one_of("precision.fp8_grouped_gemm", p.fp8_grouped_gemm, ("cutlass", "triton"))
    _one_of("precision.fp8_weight_grad", p.fp8_weight_grad, ("fp8", "bf16"))
    _non_negative(cfg, "precision.fp8_bf16_first_layers", "precision.fp8_bf16_last_layers")
    for key in ("fp8_bf16_first_layers", "fp8_bf16_last_layers"):  # as fp8_exclude: name real layers
        value = getattr(p, key)
        _require(value <= cfg.model.n_layers, f"precision.{key}={value} exceeds model.n_layers="
                 f"{cfg.model.n_layers}; allowed: 0 to {cfg.model.n_layers}")
    for pattern in p.fp8_exclude:
        _require(bool(pattern.strip()), f"precision.fp8_exclude={p.fp8_exclude} has an empty pattern; "
                 "allowed: fnmatch patterns over module names, e.g. 'layers.0.*'")
    _require_effect(p.fp8 != "off" or not p.fp8_weight_cache, "precision.fp8_weight_cache",
                    "precision.fp8_weight_cache=true caches FP8 weights: it needs precision.fp8 "
             f"({', '.join(FP8_RECIPES[1:])}), not 'off'")
    if p.fp8 == "off":  # apply_fp8 returns before reading any of them
        for key in ("fp8_exclude", "fp8_bf16_first_layers", "fp8_bf16_last_layers", "fp8_grouped_gemm",
                    "fp8_weight_grad", "fp8_saved_activations", "fp8_emulate"):
            value = getattr(p, key)
            _require_effect(value == getattr(PrecisionConfig(), key), f"precision.{key}",
                            f"precision.{key}={_shown(value)} needs "
                     f"precision.fp8 ({', '.join(FP8_RECIPES[1:])}), not 'off'")


# A name that already recomputes everything the listed ones would.
_RECOMPUTE_COVERS = {"layer": set(MEMORY_MODULES) - {"layer"}, "moe": {"moe_act", "shared_experts"}}


def _validate_memory(cfg: Config) -> None:
    mem = cfg.memory
    for key in ("recompute", "offload"):
        names = getattr(mem, key)
        validate_memory_names(key, names)
        for name in names:
            _require_effect(_memory_module_exists(cfg, name), f"memory.{key}", f"memory.{key}={name!r} does "
                            f"nothing here: {_MEMORY_MODULE_NEEDS.get(name)}", unset=[n for n in names if n != name])
    refuse_recomputed_twice(mem.recompute)
    refuse_offload_against(mem.recompute, mem.offload, mem.offload_min_bytes)
    _require_effect(bool(mem.offload) or mem.offload_min_bytes == MemoryConfig.offload_min_bytes,
                    "memory.offload_min_bytes", f"memory.offload_min_bytes={mem.offload_min_bytes} needs "
                    "memory.offload (no module's activations move to the host)")
    # Their output discarding (memory/recompute.py) rebuilds in eager backward what the producer's
    # forward saved; compiled, that forward saved other tensors (an RMSNorm: 3, eager 6).
    compiled = [name for name in ("norm", "mla_up_proj") if cfg.train.compile and name in mem.recompute]
    _require(not compiled, f"memory.recompute={mem.recompute} with train.compile=true: {', '.join(compiled)} "
             "cannot recompute inside a compiled block; drop it or train.compile (the compiler "
             "recomputes cheap ops on its own)")


def validate_memory_names(key: str, names: list[str]) -> None:
    """`memory.<key>`'s names known, each once: `validate`'s check, which `apply_recompute` and
    `apply_offload` run on names given in Python."""
    _require(not isinstance(names, str), f"memory.{key}={names!r} is not a list of names "
             f"(any of {', '.join(MEMORY_MODULES)})")  # iterated, it would be read letter by letter
    for name in names:
        _one_of(f"memory.{key}", name, MEMORY_MODULES)
        _require(names.count(name) == 1, f"memory.{key}={names} lists {name!r} twice")


def refuse_offload_against(recompute: list[str], offload: list[str], min_bytes: int) -> None:
    """memory.offload's checks against the other memory options (`validate`'s, and
    `apply_offload`'s with the names the model already recomputes)."""
    _require(min_bytes >= 0, f"memory.offload_min_bytes={min_bytes} must be >= 0")
    both = sorted(set(recompute) & set(offload))
    _require_effect(not both, "memory.offload", f"memory.offload={offload}: {', '.join(both)} is also recomputed, "
                    "so it keeps no activations to offload; list it in one of memory.recompute, memory.offload",
                    unset=[n for n in offload if n not in both])


def refuse_recomputed_twice(recompute: list[str]) -> None:
    """No name inside another listed one (`validate`'s check, and `apply_recompute`'s): wrapped
    twice, an output-discarding site inside a checkpointed region stopped backward with a
    RuntimeError about storage sizes."""
    for outer, inner in _RECOMPUTE_COVERS.items():
        both = sorted(inner & set(recompute)) if outer in recompute else []
        _require_effect(not both, "memory.recompute", f"memory.recompute={recompute}: {outer!r} already recomputes "
                        f"{', '.join(both)}; list only one of them", unset=[n for n in recompute if n not in both])


_MEMORY_MODULE_NEEDS = {"mla_up_proj": "it needs model.attention='mla'",
                        "moe_act": "it needs MoE layers (moe.num_experts > 0)",
                        "moe": "it needs MoE layers (moe.num_experts > 0)",
                        "shared_experts": "it needs moe.shared_experts > 0 and MoE layers",
                        "mlp": "the model has no dense MLP layer"}


def _memory_module_exists(cfg: Config, name: str) -> bool:
    m = cfg.model
    blocks = m.n_layers + m.mtp_layers
    moe_blocks = moe_layers_in(cfg, range(blocks))  # counted, not visited: a model may have 10^8 layers
    return {"mla_up_proj": m.attention == "mla", "moe_act": moe_blocks > 0, "moe": moe_blocks > 0,
            "shared_experts": moe_blocks > 0 and cfg.moe.shared_experts > 0,
            "mlp": moe_blocks < blocks}.get(name, True)


def moe_layers_in(cfg: Config, layer_ids: range) -> int:
    """How many of `layer_ids` (a step-1 range) `models.transformer.is_moe_layer` makes MoE layers,
    counted without visiting each: a model of 10^8 layers costs what a small one does. Here,
    without torch, for the config's own checks."""
    moe = cfg.moe
    if moe.num_experts == 0:
        return 0
    start = max(layer_ids.start, moe.first_k_dense)
    start += -(start - moe.first_k_dense) % moe.moe_every
    every = range(start, layer_ids.stop, moe.moe_every)
    return len(every) - sum(1 for i in set(moe.dense_layers) if i in every)


def validate_moe(moe: MoEConfig) -> None:
    """The [moe] checks of `validate` (ConfigError naming the field), but for `_validate_drop_policy`;
    `build_moe_layer` runs them on a MoEConfig made in Python, which no config file or command line
    has checked."""
    for key, tp in field_types().items():  # `validate`'s _finite, for the [moe] fields alone
        if key.startswith("moe."):
            _require_finite(key, tp, getattr(moe, key.removeprefix("moe.")))
    if moe.num_experts:
        _require(moe.top_k <= moe.num_experts,
                 f"moe.top_k={moe.top_k} exceeds moe.num_experts={moe.num_experts}")
    for key in ("aux_loss_coeff", "seq_aux_loss_coeff", "global_aux_loss_coeff", "z_loss_coeff",
                "input_jitter", "expert_bias_update_rate", "capacity_factor", "shared_experts",
                "shared_expert_hidden", "num_groups", "group_top_k", "group_score_top_k"):
        value = getattr(moe, key)
        _require(value >= 0, f"moe.{key}={value} must be >= 0")
    _require(moe.input_jitter < 1, f"moe.input_jitter={moe.input_jitter} must be < 1")
    _require(moe.routed_scaling_factor > 0,
             f"moe.routed_scaling_factor={moe.routed_scaling_factor} must be > 0")
    _one_of("moe.score_func", moe.score_func, ("softmax", "sigmoid"))
    _one_of("moe.router_dtype", moe.router_dtype, ("fp32", "fp64"))
    _one_of("moe.drop_policy", moe.drop_policy, ("probs", "position"))
    _one_of("moe.activation", moe.activation, ("swiglu", "gelu", "relu2"))
    _one_of("moe.experts_backend", moe.experts_backend, ("auto", "grouped_mm", "loop"))
    _require(moe.pad_multiple in (0, 8, 16, 32, 64, 128),
             f"moe.pad_multiple={moe.pad_multiple} is not one of 0, 8, 16, 32, 64, 128")
    _require_effect(moe.score_func == "softmax" or moe.softmax_before_topk, "moe.softmax_before_topk",
                    "moe.softmax_before_topk=false needs moe.score_func='softmax'")
    _require_effect(moe.capacity_factor > 0 or not moe.pad_to_capacity, "moe.pad_to_capacity",
                    "moe.pad_to_capacity=true needs moe.capacity_factor > 0")
    if moe.num_experts:  # without routed experts every layer is dense: no router to group
        _validate_groups(moe)
    _validate_unread_moe_options(moe)


def _validate_unread_moe_options(moe: MoEConfig) -> None:
    """Options the layer never reads: a gate or hidden size for shared experts it does not have
    (layer._build_shared), a bias step without the bias (Router.update_expert_bias), a
    renormalisation of a softmax over the K chosen, which sums to 1 already (TopKThenSoftmax)."""
    if moe.shared_experts == 0:
        _require_effect(not moe.shared_expert_gate, "moe.shared_expert_gate",
                        "moe.shared_expert_gate=true needs moe.shared_experts > 0")
        _require_effect(moe.shared_expert_hidden == 0, "moe.shared_expert_hidden",
                        f"moe.shared_expert_hidden={moe.shared_expert_hidden} needs moe.shared_experts > 0")
    _require_effect(moe.expert_bias or moe.expert_bias_update_rate == MoEConfig.expert_bias_update_rate,
                    "moe.expert_bias_update_rate", f"moe.expert_bias_update_rate={moe.expert_bias_update_rate} "
                    "needs moe.expert_bias=true (no expert bias to update)")
    _require_effect(moe.norm_topk_prob or moe.softmax_before_topk, "moe.norm_topk_prob", "moe.norm_topk_prob=false "
                    "needs moe.softmax_before_topk=true (a softmax over the K chosen sums to 1 already)")


def _validate_drop_policy(moe: MoEConfig) -> None:
    """Dropless routing drops nothing for a policy to choose. A config check, not one of
    validate_moe's: `moefold generate` builds its dropless layers (capacity_factor=0) with the
    run's drop_policy."""
    _require_effect(moe.capacity_factor > 0 or moe.drop_policy == MoEConfig.drop_policy, "moe.drop_policy",
                    f"moe.drop_policy={moe.drop_policy!r} needs moe.capacity_factor > 0 (dropless routing "
                    "drops no token)")


def _validate_groups(moe: MoEConfig) -> None:
    if moe.num_groups <= 1:
        for key in ("group_top_k", "group_score_top_k"):
            _require_effect(getattr(moe, key) == 0, f"moe.{key}",
                            f"moe.{key}={getattr(moe, key)} needs moe.num_groups > 1")
        return
    _require(moe.num_experts % moe.num_groups == 0,
             f"moe.num_experts={moe.num_experts} is not divisible by moe.num_groups={moe.num_groups}")
    _require(1 <= moe.group_top_k <= moe.num_groups,
             f"moe.group_top_k={moe.group_top_k} must be in [1, moe.num_groups={moe.num_groups}]")
    if moe.group_score_top_k == 0:
        _require(moe.top_k % moe.group_top_k == 0,
                 f"moe.top_k={moe.top_k} is not divisible by moe.group_top_k={moe.group_top_k}")
    per_group = moe.num_experts // moe.num_groups
    _require(moe.group_score_top_k <= per_group,
             f"moe.group_score_top_k={moe.group_score_top_k} exceeds the {per_group} experts of a group")
    experts_in_groups = moe.group_top_k * moe.num_experts // moe.num_groups
    _require(moe.top_k <= experts_in_groups,
             f"moe.top_k={moe.top_k} exceeds the {experts_in_groups} experts of "
             f"moe.group_top_k={moe.group_top_k} groups")


# Sizes the layout accepts but the trainer cannot run yet; the other checks live in ParallelDims
# (sizes >= 1, order, pipeline stages) and ParallelDims.validate (how the model fits).
_PARALLEL_NOT_YET = ("cp", "pp", "vpp")


def _validate_parallel(cfg: Config) -> None:
    from moefold.parallel.dims import ParallelDims  # torch-free

    p, m = cfg.parallel, cfg.model
    _one_of("parallel.data_parallel", p.data_parallel, ("fsdp", "ddp"))
    _one_of("parallel.ep_dispatcher", p.ep_dispatcher, ("alltoall", "allgather"))
    if cfg.moe.pad_to_capacity and p.ep * p.etp > 1:
        refuse_padded_capacity_without_alltoall(p.ep_dispatcher)
    # The world size is known only at launch; the smallest world both grids fit checks everything
    # that does not depend on it.
    dims = ParallelDims.smallest(p.tp, p.cp, p.pp, p.ep, p.etp, p.order)
    moe_layers = moe_layers_in(cfg, range(m.n_layers + m.mtp_layers))  # main and MTP blocks
    dims.validate(num_experts=cfg.moe.num_experts, n_heads=m.n_heads,
                  n_kv_heads=m.n_kv_heads if m.attention == "gqa" else 0,
                  n_layers=m.n_layers, seq_len=cfg.train.seq_len, expert_hidden=cfg.moe.expert_hidden,
                  ffn_hidden=m.ffn_hidden if moe_layers < m.n_layers + m.mtp_layers else 0,
                  shared_hidden=cfg.moe.shared_experts * (cfg.moe.shared_expert_hidden or cfg.moe.expert_hidden)
                  if moe_layers else 0)
    _require(p.vpp >= 1, f"parallel.vpp={p.vpp} must be >= 1")
    # TP ranks split what their CP rank holds: seq_len / cp tokens of each sequence (validate
    # checked seq_len % 2·cp), as Megatron-Core's sequence-parallel scatter needs.
    divisor = f"parallel.tp={p.tp}" if p.cp == 1 else f"parallel.cp·tp = {p.cp * p.tp}"
    _require(not p.shards_sequence or cfg.train.seq_len % (p.cp * p.tp) == 0,
             f"parallel.sequence_parallel needs train.seq_len={cfg.train.seq_len} divisible by "
             f"{divisor} (set parallel.sequence_parallel=false otherwise)")
    tokens = cfg.train.micro_batch_size * cfg.train.seq_len // p.cp
    _require(cfg.moe.num_experts == 0 or tokens % p.tp == 0,
             f"parallel.tp={p.tp} does not divide the {tokens} tokens of a micro-batch "
             f"(train.micro_batch_size · train.seq_len{'' if p.cp == 1 else ' / parallel.cp'}), "
             "which its ranks split for the routed experts")


def refuse_padded_capacity_without_alltoall(dispatcher: str) -> None:
    """`moe.pad_to_capacity` under expert parallelism: checked with the config, and again where
    `apply_ep` picks the dispatcher of a layer built without one."""
    _require(dispatcher == "alltoall",
             f"moe.pad_to_capacity=true under parallel.ep·etp > 1 needs parallel.ep_dispatcher='alltoall', "
             f"not {dispatcher!r} (the all-gather dispatcher's expert buffer has a static size already)")


def refuse_unsupported_parallel(cfg: Config) -> None:
    """Training-time check: sizes the layout (and the memory planner) accept but training cannot
    run yet."""
    for name in _PARALLEL_NOT_YET:
        size = getattr(cfg.parallel, name)
        _require(size == 1, f"parallel.{name}={size} is not yet supported in training (only 1)")
