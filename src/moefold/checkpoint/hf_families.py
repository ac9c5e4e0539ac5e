"""The Hugging Face families as data: config.json keys ↔ `Config`, and tensor names.

A `Family` holds the tensor-name tables of one `model_type` and its two config converters; the
generic reader and writer in `hf.py` look a family up once and never branch on it.

Name tables map a moefold name inside a scope to the Hugging Face name inside the same scope:
  top    the whole model (`tok_embeddings.weight` ↔ `model.embed_tokens.weight`)
  block  a transformer block, `layers.{i}.` ↔ `model.layers.{i}.`; an MTP module's block,
         `mtp.layers.{k}.block.` ↔ `model.layers.{L+k}.` (DeepSeek-V3 stores MTP module k as layer L+k)
  mtp    the rest of MTP module k, `mtp.layers.{k}.` ↔ `model.layers.{L+k}.`
A value is the HF name (same tensor, same layout) or a `PerExpert` pattern: our stacked `[E, in, out]`
expert weight is E Hub tensors `[out, in]` (nn.Linear layout), one per expert. transformers 5.x
fuses experts in memory (`experts.gate_up_proj` [E, 2F, D], `experts.down_proj` [E, D, F]) but its
`save_pretrained` writes, and its `from_pretrained` converts from, these per-expert Hub names.

How the MoE layers train (`TRAINING_MOE_FIELDS`: aux losses, the expert-bias update rate,
capacity, ...) is not the architecture. config.json states one part of it, the load-balancing loss
(`router_aux_loss_coef`; DeepSeek's `aux_loss_alpha` and `seq_aux`): the family converters map it
both ways, and `convert --from-hf` keeps it; `--init-from-hf` takes all of `TRAINING_MOE_FIELDS`
from the user's --config instead (without one, the loss from config.json, `HF_LOSS_FIELDS`). The
rest keep moefold's defaults.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moefold.config import Config, MoEConfig
from moefold.errors import CheckpointError
from moefold.models.transformer import is_moe_layer
from moefold.moe.router import GroupLimitedSelection

TRAINING_MOE_FIELDS = ("router_dtype", "z_loss_coeff", "aux_loss_coeff", "seq_aux_loss_coeff",
                       "global_aux_loss_coeff", "expert_bias_update_rate", "force_balanced",
                       "capacity_factor", "drop_policy", "pad_to_capacity", "pad_multiple",
                       "memory_efficient_permute", "experts_backend")
"""[moe] fields of how a model trains, not what it is (config.json holds at most its aux-loss
coefficient): `--init-from-hf` takes them from the user's config."""
HF_LOSS_FIELDS = ("aux_loss_coeff", "seq_aux_loss_coeff", "global_aux_loss_coeff")
"""The fields of `TRAINING_MOE_FIELDS` that config.json's load-balancing keys set: `--init-from-hf`
without a --config takes these from config.json rather than moefold's generic defaults."""


@dataclass(frozen=True)
class PerExpert:
    """One Hub tensor per expert (`{e}` in the name), stored transposed relative to our `[E, in, out]`."""
    hf: str


Rule = str | PerExpert


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str
    block: dict[str, Rule]
    config_from_hf: Callable[[dict[str, Any]], Config]
    config_to_hf: Callable[[Config], dict[str, Any]]
    top: dict[str, Rule] = field(default_factory=lambda: dict(_TOP))
    mtp: dict[str, Rule] = field(default_factory=dict)
    mtp_copies: dict[str, str] = field(default_factory=dict)
    """HF names inside an MTP layer that duplicate a top-level moefold tensor (shared with the main
    model): checked equal on import, written on export."""
    keep_fp32: tuple[str, ...] = ()
    """Endings of the HF names transformers holds in fp32 whatever the model's dtype (its
    `_keep_in_fp32_modules_strict`), and so writes in fp32 in a bf16 or fp16 checkpoint."""
    empty_tensors: Callable[[Config], dict[str, tuple[int, ...]]] = lambda cfg: {}
    """HF name → shape of the zero-element tensors transformers holds, and its save_pretrained
    writes, where the model `cfg` builds has no tensor (DeepSeek-V3's shared experts of width 0):
    optional on import (else shaped so), written on export, as its from_pretrained reports them
    missing without."""
    keys: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """config.json keys of the `Config` fields the family reads as they are (beside `_KEYS`), the
    first present of several (aliases): `validate`'s refusals of an import name them."""
    non_null: tuple[str, ...] = ()
    """config.json keys whose null transformers cannot build the model from: its config class's
    fields typed without None (a strict dataclass refuses null), and those its modeling compares
    or divides by. Refused by name rather than read as the default (`refuse_nulls`)."""
    class_defaults: dict[str, Any] = field(default_factory=dict)
    """The config class's defaults of the sizes the readers take without one of their own: where
    config.json leaves such a key out (and its aliases), transformers builds with these
    (`with_class_defaults`)."""


# ---------------------------------------------------------------------------------------------
# Tensor-name tables
# ---------------------------------------------------------------------------------------------

_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_NORMS = {"attn_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight"}
_GQA = {f"attn.w{x}.weight": f"self_attn.{x}_proj.weight" for x in "qkvo"}
_QK_NORM = {"attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight"}
_MLA = {"attn.wq.weight": "self_attn.q_proj.weight", "attn.wq_a.weight": "self_attn.q_a_proj.weight",
        "attn.q_norm.weight": "self_attn.q_a_layernorm.weight", "attn.wq_b.weight": "self_attn.q_b_proj.weight",
        "attn.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attn.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attn.wkv_b.weight": "self_attn.kv_b_proj.weight", "attn.wo.weight": "self_attn.o_proj.weight"}
_DENSE_MLP = {"ffn.w1.weight": "mlp.gate_proj.weight", "ffn.w3.weight": "mlp.up_proj.weight",
              "ffn.w2.weight": "mlp.down_proj.weight"}
_SHARED = {"ffn.shared.w1.weight": "mlp.shared_experts.gate_proj.weight",
           "ffn.shared.w3.weight": "mlp.shared_experts.up_proj.weight",
           "ffn.shared.w2.weight": "mlp.shared_experts.down_proj.weight"}


def _moe(module: str, gate: str, up: str, down: str) -> dict[str, Rule]:
    return {"ffn.router.weight": f"{module}.gate.weight",
            "ffn.experts.w1_EDF": PerExpert(f"{module}.experts.{{e}}.{gate}.weight"),
            "ffn.experts.w3_EDF": PerExpert(f"{module}.experts.{{e}}.{up}.weight"),
            "ffn.experts.w2_EFD": PerExpert(f"{module}.experts.{{e}}.{down}.weight")}


_QWEN3_MOE_BLOCK = {**_NORMS, **_GQA, **_QK_NORM, **_DENSE_MLP, **_moe("mlp", "gate_proj", "up_proj", "down_proj")}
_MIXTRAL_BLOCK = {**_NORMS, **_GQA, **_moe("block_sparse_moe", "w1", "w3", "w2")}
_DEEPSEEK_V3_BLOCK = {**_NORMS, **_MLA, **_DENSE_MLP, **_moe("mlp", "gate_proj", "up_proj", "down_proj"),
                      **_SHARED, "ffn.router.expert_bias_E": "mlp.gate.e_score_correction_bias"}
_DEEPSEEK_V3_MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
                    "eh_proj.weight": "eh_proj.weight", "norm.weight": "shared_head.norm.weight"}
_DEEPSEEK_V3_MTP_COPIES = {"embed_tokens.weight": "tok_embeddings.weight",
                           "shared_head.head.weight": "output.weight"}


# ---------------------------------------------------------------------------------------------
# config.json → Config: shared helpers
# ---------------------------------------------------------------------------------------------

_KEYS = {"model.vocab_size": ("vocab_size",), "model.dim": ("hidden_size",),
         "model.n_layers": ("num_hidden_layers",), "model.n_heads": ("num_attention_heads",),
         "model.n_kv_heads": ("num_key_value_heads",), "model.head_dim": ("head_dim",),
         "model.norm_eps": ("rms_norm_eps",), "model.max_position_embeddings": ("max_position_embeddings",),
         "model.sliding_window": ("sliding_window",), "model.ffn_hidden": ("intermediate_size",),
         "moe.top_k": ("num_experts_per_tok",), "moe.expert_hidden": ("moe_intermediate_size",),
         "model.init_std": ("initializer_range",), "moe.aux_loss_coeff": ("router_aux_loss_coef",)}
"""config.json keys of the `Config` fields every family reads as they are (`Family.keys`)."""


# A config class's field and its alias (attribute_map), the alias first: transformers sets it after the
# field (the dataclass's), so where config.json holds both the alias wins.
_QWEN3_MOE_EXPERTS = ("num_local_experts", "num_experts")
_MIXTRAL_EXPERTS = ("num_experts", "num_local_experts")
_DEEPSEEK_V3_EXPERTS = ("num_local_experts", "n_routed_experts")


def _present(hf: dict[str, Any], keys: tuple[str, ...]) -> str:
    """The first of `keys` config.json holds, else the last (to name as missing)."""
    return next((k for k in keys if k in hf), keys[-1])


def refuse_nulls(family: Family, hf: dict[str, Any]) -> None:
    """Refuses a null under a key of `family.non_null`, naming it."""
    for key in family.non_null:
        if key in hf and hf[key] is None:
            raise CheckpointError(f"config.json: {key}=null is not allowed: transformers' {family.architecture} "
                                  "needs a value (give one, or leave the key out for its config class's default)")


def with_class_defaults(family: Family, hf: dict[str, Any]) -> dict[str, Any]:
    """config.json `hf` with `family.class_defaults` for the keys it leaves out, none of their
    aliases given either (a null stays: `refuse_nulls` refuses it by name)."""
    aliases = [*_KEYS.values(), *family.keys.values()]
    filled = dict(hf)
    for key, value in family.class_defaults.items():
        names = next((names for names in aliases if key in names), (key,))
        if not any(name in hf for name in names):
            filled[key] = value
    return filled


def config_json_keys(family: Family, hf: dict[str, Any]) -> dict[str, str]:
    """moefold field → the config.json key it was read from, for `family`'s config.json `hf`."""
    keys = {**_KEYS, **family.keys}
    return {name: next((k for k in options if k in hf), options[0]) for name, options in keys.items()}


# ---------------------------------------------------------------------------------------------
# config.json → Config: readers
# ---------------------------------------------------------------------------------------------


def _get(hf: dict[str, Any], key: str, default: Any = ...) -> Any:
    """hf[key], `default` when absent or null; without a default a missing key is an error."""
    value = hf.get(key)
    if value is None:
        if default is ...:
            raise CheckpointError(f"config.json has no {key}")
        return default
    return value


_KINDS = {int: "an integer", float: "a number", bool: "true or false", dict: "an object"}
_JSON_KINDS = {str: "string", bool: "boolean", int: "integer", float: "number with a decimal point or exponent",
               list: "array", dict: "object"}


def _typed(hf: dict[str, Any], key: str, kind: type, default: Any = ..., where: str = "") -> Any:
    """hf[key] as `_get` reads it, refused in one line unless it is a `kind`. An integer takes no
    float (3.0 layers: transformers' config classes refuse it too) and no boolean; a float takes an
    integer (1 for 1.0, as a moefold TOML config does). `where`: the object holding `key` ("rope_scaling.")."""
    value = hf.get(key)
    if value is None:
        return _get(hf, key, default)
    if kind is float and type(value) is int:
        return float(value)
    if type(value) is not kind:
        raise CheckpointError(f"config.json: {where}{key}={json.dumps(value)} is not {_KINDS[kind]} "
                              f"(a JSON {_JSON_KINDS.get(type(value), type(value).__name__)})")
    return value


def _int(hf: dict[str, Any], key: str, default: Any = ...) -> int:
    return _typed(hf, key, int, default)


def _float(hf: dict[str, Any], key: str, default: Any = ..., where: str = "") -> float:
    return _typed(hf, key, float, default, where)


def _bool(hf: dict[str, Any], key: str, default: bool, where: str = "") -> bool:
    """`default` when absent; false when null, as transformers' modeling reads a flag (`if
    config.norm_topk_prob:`; DeepseekV3Config keeps a null norm_topk_prob and rope_interleave)."""
    return False if key in hf and hf[key] is None else _typed(hf, key, bool, default, where)


def _positive(hf: dict[str, Any], key: str, default: Any = ..., where: str = "", kind: type = int) -> Any:
    """hf[key] as `_typed` reads it, refused unless > 0: transformers reads a 0 literally (and
    builds a broken model) where moefold's 0 of the same field means "derive it" or "none"."""
    value = _typed(hf, key, kind, default, where)
    if not value > 0:  # NaN too
        raise CheckpointError(f"config.json: {where}{key}={json.dumps(hf.get(key, value))} must be > 0")
    return value


def _given_positive(hf: dict[str, Any], key: str, where: str = "", kind: type = float) -> Any:
    """hf[key] as `_positive` reads it; 0 when absent or null (for the caller to derive it)."""
    return 0 if hf.get(key) is None else _positive(hf, key, where=where, kind=kind)


def _int_list(hf: dict[str, Any], key: str) -> list[int]:
    value = _get(hf, key, [])
    if type(value) is not list or any(type(v) is not int for v in value):
        raise CheckpointError(f"config.json: {key}={json.dumps(value)} is not a list of integers")
    return value


def token_ids(value: Any, where: str) -> list[int]:
    """A special-token id as transformers reads it (an integer or a list of them; null: none) as a
    list; anything else is refused in one line naming `where` (the file and key)."""
    ids = [] if value is None else value if type(value) is list else [value]
    if any(type(i) is not int for i in ids):
        raise CheckpointError(f"{where}={json.dumps(value)} is not a token id (an integer or a list of them)")
    return ids


def single_token_id(value: Any, where: str) -> list[int]:
    """A bos or pad token id as transformers 5's config classes take it (an integer, or null: none)
    as a list of at most one; anything else is refused in one line naming `where`."""
    if value is not None and type(value) is not int:
        raise CheckpointError(f"{where}={json.dumps(value)} is not a token id (an integer or null)")
    return [] if value is None else [value]


def _require(hf: dict[str, Any], key: str, allowed: tuple, default: Any) -> None:
    """hf[key] (`default` when absent or null) must be one of `allowed`."""
    value = _get(hf, key, default)
    if value not in allowed:
        raise CheckpointError(f"config.json: {key}={value!r} is not supported (supported: "
                              f"{', '.join(repr(a) for a in allowed)})")


def _common_from_hf(hf: dict[str, Any], family: str, default_theta: float, default_eps: float,
                    default_max_len: int, default_eos: int | None, default_bos: int | None) -> Config:
    """The fields every family shares: sizes, norms, embeddings, RoPE, and the unsupported options.
    The defaults: the family config class's, which transformers builds with where a key is absent."""
    if hf.get("quantization_config"):
        method = _typed(hf, "quantization_config", dict).get("quant_method", "?")
        raise CheckpointError(f"config.json: quantization_config (quant_method={method!r}) is not "
                              "supported; dequantize the checkpoint to bf16/fp32 first")
    _require(hf, "hidden_act", ("silu", "swish"), "silu")  # one function: transformers' ACT2FN maps both to SiLU
    # mlp_bias: no family's modeling reads it (their MLPs and experts have no bias); attention_bias: per family
    _require(hf, "attention_dropout", (0, 0.0), 0.0)
    cfg = Config()
    m = cfg.model
    m.family = family
    m.vocab_size = _int(hf, "vocab_size")
    if m.vocab_size < 1:  # moefold's 0 would mean "the tokenizer's": no vocabulary of the checkpoint's
        raise CheckpointError(f"config.json: vocab_size={m.vocab_size} must be positive")
    m.dim = _positive(hf, "hidden_size")
    m.n_layers = _positive(hf, "num_hidden_layers")
    m.n_heads = _positive(hf, "num_attention_heads")
    m.norm_eps = _float(hf, "rms_norm_eps", default_eps)
    m.tie_embeddings = _bool(hf, "tie_word_embeddings", False)
    m.init_std = _float(hf, "initializer_range", m.init_std)
    m.max_position_embeddings = _int(hf, "max_position_embeddings", default_max_len)  # transformers builds with it
    # absent: the config class's (Mixtral's 2), where transformers' generate stops; null: none
    m.eos_token_ids = token_ids(hf.get("eos_token_id", default_eos), "config.json: eos_token_id")
    m.bos_token_ids = single_token_id(hf.get("bos_token_id", default_bos), "config.json: bos_token_id")
    m.pad_token_ids = single_token_id(hf.get("pad_token_id"), "config.json: pad_token_id")  # None in each class
    _rope_from_hf(hf, cfg, default_theta, default_max_len)
    return cfg


def _rope_dict(hf: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The key and the dict of the RoPE parameters: transformers takes a non-empty rope_scaling over
    rope_parameters, in either order in the file."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    return key, dict(_typed(hf, key, dict, {}))


def _rope_from_hf(hf: dict[str, Any], cfg: Config, default_theta: float, default_max_len: int) -> None:
    """RoPE from the Hub's `rope_theta` + `rope_scaling` or transformers 5's `rope_parameters`,
    resolved as transformers' `standardize_rope_params` and `_compute_yarn_parameters` do."""
    m = cfg.model
    key, params = _rope_dict(hf)
    where = f"{key}."
    # transformers takes rope_parameters' theta, else the top-level one, as is (a 0 is 1 / 0 ** (2i/d))
    if params.get("rope_theta") is not None:
        m.rope_theta = _positive(params, "rope_theta", where=where, kind=float)
    else:
        m.rope_theta = _positive(hf, "rope_theta", default_theta, kind=float)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return
    if rope_type != "yarn":
        raise CheckpointError(f"config.json: {key}.rope_type={rope_type!r} is not supported (default, yarn)")
    _yarn_from_hf(hf, key, params, cfg, default_max_len)


def _yarn_from_hf(hf: dict[str, Any], key: str, params: dict[str, Any], cfg: Config, default_max_len: int) -> None:
    """YaRN from `params` (config.json's `key`), missing lengths taken as `standardize_rope_params`
    takes them (`default_max_len`: the config class's max_position_embeddings)."""
    m, where = cfg.model, f"{key}."
    for name, allowed in (("attention_factor", (None,)), ("partial_rotary_factor", (None, 1, 1.0))):
        if params.get(name) not in allowed:
            raise CheckpointError(f"config.json: {key}.{name}={params[name]!r} is not supported")
    if "factor" not in params:  # transformers' YaRN validation: "Missing required keys ... {'factor'}"
        raise CheckpointError(f"config.json: {key} is yarn without a factor (transformers requires the key); "
                              f"give {key}.factor, or null for max_position_embeddings / "
                              "original_max_position_embeddings")
    # a 0 given is read as is there (a division by it, inverse frequencies of inf): refused
    max_len = _positive(hf, "max_position_embeddings", default_max_len)
    original = (_given_positive(hf, "original_max_position_embeddings")
                or _given_positive(params, "original_max_position_embeddings", where) or max_len)
    factor = _given_positive(params, "factor", where)  # null: transformers derives it as max / original
    m.rope_scaling = "yarn"
    m.rope_original_max_len = int(original)
    m.rope_factor = factor or max_len / original
    if m.rope_factor < 1:  # transformers warns and compresses; moefold's YaRN only extends
        given = f"{factor!r}" if factor else (f"null is max_position_embeddings / original_max_position_embeddings = "
                                              f"{max_len} / {m.rope_original_max_len} = {m.rope_factor}, which")
        raise CheckpointError(f"config.json: {key}.factor={given} must be >= 1")
    m.yarn_beta_fast = _float(params, "beta_fast", 0.0, where) or 32.0
    m.yarn_beta_slow = _float(params, "beta_slow", 0.0, where) or 1.0
    # transformers uses mscale only together with a non-zero mscale_all_dim; 0 keeps that reading.
    m.yarn_mscale = _float(params, "mscale", 0.0, where)
    m.yarn_mscale_all_dim = _float(params, "mscale_all_dim", 0.0, where)
    # absent: rounded (transformers' default); null is false there (`if truncate:`)
    m.yarn_truncate = _bool(params, "truncate", True, where)


def _gqa_from_hf(hf: dict[str, Any], cfg: Config, default_kv_heads: int, zero_head_dim_derives: bool) -> None:
    """`default_kv_heads`: the family config class's num_key_value_heads, which transformers builds
    the model with when config.json leaves the key out (not num_attention_heads).
    `zero_head_dim_derives`: the family's attention reads `head_dim or hidden_size // heads`
    (Mixtral); else a head_dim of 0 is taken literally there, and refused here."""
    m = cfg.model
    m.attention = "gqa"
    m.n_kv_heads = _positive(hf, "num_key_value_heads", default_kv_heads)  # moefold's 0: n_heads
    derived = m.dim // m.n_heads
    if zero_head_dim_derives and _int(hf, "head_dim", 0) == 0:
        m.head_dim = derived
    elif "head_dim" in hf and hf["head_dim"] is None:  # getattr(config, "head_dim", ...) is None there
        raise CheckpointError("config.json: head_dim=null must be > 0")
    else:
        m.head_dim = _positive(hf, "head_dim", derived)


# ---------------------------------------------------------------------------------------------
# Config → config.json: shared helpers
# ---------------------------------------------------------------------------------------------


def _expressible(ok: bool, key: str, value: Any, family: str, why: str) -> None:
    if not ok:
        raise CheckpointError(f"{key}={value!r} cannot be saved as a {family} checkpoint: {why}")


def _common_to_hf(cfg: Config, family: str) -> dict[str, Any]:
    m, moe = cfg.model, cfg.moe
    _expressible(moe.activation == "swiglu", "moe.activation", moe.activation, family, "experts use SwiGLU")
    _expressible(not moe.shared_expert_gate, "moe.shared_expert_gate", True, family, "no shared-expert gate")
    _expressible(not moe.force_balanced, "moe.force_balanced", True, family,
                 "transformers routes each token by its router, which round-robin routing never used")
    hf = {"model_type": family, "hidden_size": m.dim, "num_hidden_layers": m.n_layers,
          "num_attention_heads": m.n_heads, "rms_norm_eps": m.norm_eps, "hidden_act": "silu",
          "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": m.tie_embeddings,
          "initializer_range": m.init_std, "num_experts_per_tok": moe.top_k,
          "rope_theta": m.rope_theta, "rope_scaling": None,
          "use_cache": True}
    if m.rope_scaling == "yarn":
        hf["rope_scaling"] = {"rope_type": "yarn", "factor": m.rope_factor,
                              "original_max_position_embeddings": m.rope_original_max_len,
                              "beta_fast": m.yarn_beta_fast, "beta_slow": m.yarn_beta_slow,
                              "mscale": m.yarn_mscale, "mscale_all_dim": m.yarn_mscale_all_dim}
        if not m.yarn_truncate:  # the key only where it is not transformers' default
            hf["rope_scaling"]["truncate"] = False
    stated = m.stated_context()
    hf["max_position_embeddings"] = stated[0] if stated else max(cfg.train.seq_len, 4096)
    return hf


def _gqa_to_hf(cfg: Config, family: str, qk_norm: bool) -> dict[str, Any]:
    m = cfg.model
    _expressible(m.attention == "gqa", "model.attention", m.attention, family, "it uses GQA")
    _expressible(m.qk_norm == qk_norm, "model.qk_norm", m.qk_norm, family, f"its QK-norm is {qk_norm}")
    _expressible(not m.rope_interleaved, "model.rope_interleaved", True, family, "rotate-half RoPE only")
    _expressible(m.mtp_layers == 0, "model.mtp_layers", m.mtp_layers, family, "no MTP modules")
    return {"num_key_value_heads": m.n_kv_heads or m.n_heads, "head_dim": m.head_dim or m.dim // m.n_heads}


def _softmax_router_to_hf(cfg: Config, family: str) -> None:
    moe = cfg.moe
    for key, ok in (("score_func", moe.score_func == "softmax"), ("expert_bias", not moe.expert_bias),
                    ("routed_scaling_factor", moe.routed_scaling_factor == 1.0),
                    ("num_groups", moe.num_groups <= 1), ("shared_experts", moe.shared_experts == 0)):
        _expressible(ok, f"moe.{key}", getattr(moe, key), family, "its router is a plain softmax top-k")


def _layer_sizes_from_hf(hf: dict[str, Any], cfg: Config) -> None:
    """The dense MLP's width and the experts' width and top-k (`cfg`'s layer pattern already read)."""
    m, moe = cfg.model, cfg.moe
    blocks = m.n_layers + m.mtp_layers
    n_moe = len(_moe_layer_ids(cfg, blocks))
    m.ffn_hidden = _width(hf, "intermediate_size", n_moe < blocks, m.ffn_hidden)
    moe.top_k = _width(hf, "num_experts_per_tok", n_moe > 0, moe.top_k)
    moe.expert_hidden = _width(hf, "moe_intermediate_size", n_moe > 0, moe.expert_hidden)


def _width(hf: dict[str, Any], key: str, used: bool, default: int) -> int:
    """hf[key] > 0 where a block reads it. Where none does transformers never reads it (a 0, a
    negative or no key builds): a positive one is kept for the export, else `default` stands in."""
    if used:
        return _positive(hf, key)
    unused = _int(hf, key, 0)
    return unused if unused > 0 else default


def _moe_layer_ids(cfg: Config, n_blocks: int | None = None) -> list[int]:
    """The MoE blocks among the first `n_blocks` (default: the main layers; MTP blocks follow them)."""
    return [i for i in range(n_blocks or cfg.model.n_layers) if is_moe_layer(cfg, i)]


# ---------------------------------------------------------------------------------------------
# Load balancing: the aux-loss keys of config.json
# ---------------------------------------------------------------------------------------------


def _switch_aux_from_hf(hf: dict[str, Any], cfg: Config) -> None:
    """Qwen3-MoE and Mixtral: `router_aux_loss_coef` (transformers' default 0.001) weighs the
    micro-batch Switch loss. transformers pools its counts over the layers and does not divide
    them by K; the coefficient is taken as is, as each layer's weight (as Megatron-Bridge and the
    presets take it)."""
    cfg.moe.aux_loss_coeff = _float(hf, "router_aux_loss_coef", 0.001)


def _switch_aux_to_hf(cfg: Config) -> dict[str, Any]:
    """The micro-batch loss's coefficient; the sequence and global-batch losses have no key."""
    return {"router_aux_loss_coef": cfg.moe.aux_loss_coeff}


def _deepseek_aux_from_hf(hf: dict[str, Any], cfg: Config) -> None:
    """DeepSeek's MoEGate (modeling_deepseek.py): `aux_loss_alpha` weighs one balancing loss per
    MoE layer, per sequence with `seq_aux`, else over the micro-batch: E · Σ_e f_e · P_e with f over
    the K·tokens routed copies, our `seq_aux_loss` / `aux_loss` exactly. Defaults: DeepSeek's
    config class (0.001, seq_aux). DeepSeek-V3's config.json says 0.001 where its paper trained
    with 0.0001 (the `deepseek-v3` preset); the checkpoint's key is what is mapped."""
    moe = cfg.moe
    alpha = _float(hf, "aux_loss_alpha", 0.001)
    per_sequence = _bool(hf, "seq_aux", True)
    moe.aux_loss_coeff, moe.seq_aux_loss_coeff = (0.0, alpha) if per_sequence else (alpha, 0.0)


def _deepseek_aux_to_hf(cfg: Config) -> dict[str, Any]:
    """The sequence loss's coefficient when it is on (or neither is), else the micro-batch one's;
    with both on, the micro-batch loss (like the global-batch one) has no key."""
    moe = cfg.moe
    per_sequence = moe.seq_aux_loss_coeff > 0 or moe.aux_loss_coeff == 0
    alpha = moe.seq_aux_loss_coeff if per_sequence else moe.aux_loss_coeff
    return {"aux_loss_alpha": alpha, "seq_aux": per_sequence}


# ---------------------------------------------------------------------------------------------
# Qwen3-MoE
# ---------------------------------------------------------------------------------------------


def _qwen3_moe_from_hf(hf: dict[str, Any]) -> Config:
    cfg = _common_from_hf(hf, "qwen3_moe", default_theta=10000.0, default_eps=1e-6, default_max_len=32768,
                          default_eos=None, default_bos=None)
    m, moe = cfg.model, cfg.moe
    _require(hf, "attention_bias", (False,), False)
    _gqa_from_hf(hf, cfg, default_kv_heads=4, zero_head_dim_derives=False)
    m.qk_norm = True
    # As Qwen3MoeConfig: a window only with use_sliding_window; an absent key is 4096, null is none
    # (a 0 is a window of 0 there, whose mask fails: refused).
    if _bool(hf, "use_sliding_window", False):
        m.sliding_window = _given_positive(hf, "sliding_window", kind=int) if "sliding_window" in hf else 4096
    moe.num_experts = _int(hf, _present(hf, _QWEN3_MOE_EXPERTS))  # 5.x writes the alias
    moe.score_func, moe.softmax_before_topk = "softmax", True
    moe.norm_topk_prob = _bool(hf, "norm_topk_prob", False)
    # HF: layer i is MoE iff (i+1) % decoder_sparse_step == 0 and i not in mlp_only_layers.
    # transformers: (i + 1) % 0 fails; Python's % by -s is 0 exactly where the one by s is
    step = _int(hf, "decoder_sparse_step", 1)
    if step == 0:
        raise CheckpointError("config.json: decoder_sparse_step=0 must be nonzero")
    moe.first_k_dense, moe.moe_every = abs(step) - 1, abs(step)
    # transformers asks `i not in mlp_only_layers`: an id of no layer changes nothing (not refused)
    moe.dense_layers = sorted({i for i in _int_list(hf, "mlp_only_layers") if 0 <= i < m.n_layers})
    _layer_sizes_from_hf(hf, cfg)
    _switch_aux_from_hf(hf, cfg)
    return cfg


def _qwen3_moe_to_hf(cfg: Config) -> dict[str, Any]:
    m, moe = cfg.model, cfg.moe
    hf = {**_common_to_hf(cfg, "qwen3_moe"), **_gqa_to_hf(cfg, "qwen3_moe", qk_norm=True)}
    _softmax_router_to_hf(cfg, "qwen3_moe")
    # top-k of the logits then softmax over K equals softmax, top-k, renormalise.
    norm = moe.norm_topk_prob or not moe.softmax_before_topk
    moe_ids = _moe_layer_ids(cfg)
    step = moe.moe_every if all((i + 1) % moe.moe_every == 0 for i in moe_ids) else 1
    hf.update(num_experts=moe.num_experts, moe_intermediate_size=moe.expert_hidden,
              intermediate_size=m.ffn_hidden, norm_topk_prob=norm, decoder_sparse_step=step,
              mlp_only_layers=[i for i in range(m.n_layers) if (i + 1) % step == 0 and i not in moe_ids],
              use_sliding_window=m.sliding_window > 0, sliding_window=m.sliding_window or None,
              **_switch_aux_to_hf(cfg))
    return hf


# ---------------------------------------------------------------------------------------------
# Mixtral
# ---------------------------------------------------------------------------------------------


def _mixtral_from_hf(hf: dict[str, Any]) -> Config:
    cfg = _common_from_hf(hf, "mixtral", default_theta=1e6, default_eps=1e-5, default_max_len=4096 * 32,
                          default_eos=2, default_bos=1)
    m, moe = cfg.model, cfg.moe
    # attention_bias is not read: Mixtral's attention has no bias (MixtralConfig has no such key)
    _gqa_from_hf(hf, cfg, default_kv_heads=8, zero_head_dim_derives=True)
    m.qk_norm = False
    m.sliding_window = _given_positive(hf, "sliding_window", kind=int)  # null: none; 0 fails there
    m.ffn_hidden = moe.expert_hidden = _positive(hf, "intermediate_size")
    moe.num_experts = _positive(hf, _present(hf, _MIXTRAL_EXPERTS))  # every layer is MoE, even of 0 experts
    moe.top_k = _positive(hf, "num_experts_per_tok")
    moe.first_k_dense, moe.moe_every = 0, 1
    # Mixtral: softmax over all E, top-k, renormalise. The same as top-k of the logits then softmax
    # over the K (softmax is monotone, and p_i / Σ_K p_j = e^{l_i} / Σ_K e^{l_j}); we take the form
    # transformers computes, so ties and rounding follow it op for op.
    moe.score_func, moe.softmax_before_topk, moe.norm_topk_prob = "softmax", True, True
    moe.input_jitter = _float(hf, "router_jitter_noise", 0.0)
    _switch_aux_from_hf(hf, cfg)
    return cfg


def _mixtral_to_hf(cfg: Config) -> dict[str, Any]:
    m, moe = cfg.model, cfg.moe
    hf = {**_common_to_hf(cfg, "mixtral"), **_gqa_to_hf(cfg, "mixtral", qk_norm=False)}
    _softmax_router_to_hf(cfg, "mixtral")
    _expressible(moe.norm_topk_prob or not moe.softmax_before_topk, "moe.norm_topk_prob", False,
                 "mixtral", "Mixtral renormalises the top-k probabilities")
    _expressible(moe.num_experts > 0, "moe.num_experts", moe.num_experts, "mixtral", "every layer is MoE")
    _expressible(_moe_layer_ids(cfg) == list(range(m.n_layers)), "moe.first_k_dense/moe_every/dense_layers",
                 (moe.first_k_dense, moe.moe_every, moe.dense_layers), "mixtral", "every layer is MoE")
    hf.update(intermediate_size=moe.expert_hidden, num_local_experts=moe.num_experts,
              sliding_window=m.sliding_window or None, router_jitter_noise=moe.input_jitter,
              **_switch_aux_to_hf(cfg))
    return hf


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3
# ---------------------------------------------------------------------------------------------


def _deepseek_v3_from_hf(hf: dict[str, Any]) -> Config:
    cfg = _common_from_hf(hf, "deepseek_v3", default_theta=10000.0, default_eps=1e-6, default_max_len=4096,
                          default_eos=1, default_bos=0)
    m, moe = cfg.model, cfg.moe
    _require(hf, "topk_method", ("noaux_tc",), "noaux_tc")
    _require(hf, "scoring_func", ("sigmoid",), "sigmoid")
    _require(hf, "moe_layer_freq", (1,), 1)  # transformers ignores it; DeepSeek-V3 uses 1
    _require(hf, "num_key_value_heads", (m.n_heads,), m.n_heads)  # MLA expands the latent to every head
    _require(hf, "attention_bias", (False,), False)
    m.attention, m.qk_norm = "mla", False
    # null: queries projected directly; absent: DeepseekV3Config's 1536 (transformers builds q_a_proj)
    # (a 0 would be a q_a_proj of rank 0 there, no q_a_proj here: refused)
    m.q_lora_rank = 0 if "q_lora_rank" in hf and hf["q_lora_rank"] is None else _positive(hf, "q_lora_rank", 1536)
    m.kv_lora_rank = _positive(hf, "kv_lora_rank")
    m.qk_nope_head_dim = _int(hf, "qk_nope_head_dim")
    m.qk_rope_head_dim = _positive(hf, "qk_rope_head_dim")
    m.v_head_dim = _positive(hf, "v_head_dim")
    m.rope_interleaved = _bool(hf, "rope_interleave", True)
    key, rope = _rope_dict(hf)
    if m.rope_scaling == "yarn" and rope["factor"] is None and rope.get("mscale_all_dim"):
        # yarn_apply_mscale's yarn_get_mscale(None, mscale_all_dim) fails there (None <= 1)
        raise CheckpointError(f"config.json: {key}.factor=null is not supported beside {key}.mscale_all_dim="
                              f"{rope['mscale_all_dim']!r}: DeepSeek-V3's attention scales by the factor as "
                              f"written; give {key}.factor")
    # absent: DeepseekV3Config's 1 (a checkpoint without the MTP tensors loads without them);
    # below 0: none (transformers' config takes any integer, its model builds no MTP module)
    m.mtp_layers = max(_int(hf, "num_nextn_predict_layers", _int(hf, "num_mtp_layers", 1)), 0)
    # transformers' layer i is MoE where i >= first_k_dense_replace: a negative k is no dense layer
    moe.first_k_dense, moe.moe_every = max(_int(hf, "first_k_dense_replace", 3), 0), 1
    # > 0 where a block is MoE (transformers builds MoE layers of 0 experts, which fail); where none
    # is, transformers never reads it and any count builds the same model
    has_moe_block = moe.first_k_dense < m.n_layers + m.mtp_layers
    moe.num_experts = _width(hf, _present(hf, _DEEPSEEK_V3_EXPERTS), has_moe_block, moe.num_experts)
    _layer_sizes_from_hf(hf, cfg)
    # 0: transformers' shared MLP of width moe_intermediate_size·0 adds zeros (`empty_tensors`)
    moe.shared_experts = _int(hf, "n_shared_experts", 1)
    if moe.shared_experts < 0:  # a Linear of negative width there
        raise CheckpointError(f"config.json: n_shared_experts={moe.shared_experts} must be >= 0 "
                              "(0: no shared experts)")
    moe.score_func, moe.expert_bias = "sigmoid", True  # e_score_correction_bias; update rate stays ours
    moe.routed_scaling_factor = _float(hf, "routed_scaling_factor", 2.5)
    moe.norm_topk_prob = _bool(hf, "norm_topk_prob", True)
    # transformers reads both even for one group: E // 0 fails; top-0 groups zero every score
    n_group, topk_group = _positive(hf, "n_group", 8), _positive(hf, "topk_group", 4)
    if topk_group > n_group:
        raise CheckpointError(f"config.json: topk_group={topk_group} must be <= n_group={n_group}")
    if n_group > 1:  # transformers scores a group by the sum of its top-2 biased scores
        moe.num_groups, moe.group_top_k, moe.group_score_top_k = n_group, topk_group, 2
    _deepseek_aux_from_hf(hf, cfg)
    return cfg


def _experts_per_group_score(moe: MoEConfig) -> int:
    """The experts a group scores by, as routing reads moe.group_score_top_k (0: its default)."""
    return GroupLimitedSelection(moe.top_k, moe.num_groups, moe.group_top_k,
                                 moe.group_score_top_k).experts_per_group_score


def _deepseek_v3_to_hf(cfg: Config) -> dict[str, Any]:
    m, moe = cfg.model, cfg.moe
    fam = "deepseek_v3"
    hf = _common_to_hf(cfg, fam)
    _expressible(m.attention == "mla", "model.attention", m.attention, fam, "it uses MLA")
    _expressible(moe.num_experts > 0, "moe.num_experts", moe.num_experts, fam, "its layers past the first k are MoE")
    _expressible(moe.score_func == "sigmoid", "moe.score_func", moe.score_func, fam, "sigmoid routing")
    _expressible(moe.expert_bias, "moe.expert_bias", False, fam,
                 "it stores e_score_correction_bias (a zero bias is equivalent: enable it)")
    _expressible(moe.shared_expert_hidden in (0, moe.expert_hidden), "moe.shared_expert_hidden",
                 moe.shared_expert_hidden, fam, "shared experts have moe_intermediate_size")
    _expressible(moe.num_groups <= 1 or _experts_per_group_score(moe) == 2, "moe.group_score_top_k",
                 moe.group_score_top_k, fam, "a group scores by its top-2 experts")
    first, n_blocks = moe.first_k_dense, m.n_layers + m.mtp_layers
    _expressible(_moe_layer_ids(cfg, n_blocks) == list(range(first, n_blocks)),
                 "moe.first_k_dense/moe_every/dense_layers", (moe.first_k_dense, moe.moe_every, moe.dense_layers),
                 fam, "the first k layers are dense, the rest and the MTP blocks MoE")
    grouped = moe.num_groups > 1
    hf.update(num_key_value_heads=m.n_heads, q_lora_rank=m.q_lora_rank or None,
              intermediate_size=m.ffn_hidden, moe_intermediate_size=moe.expert_hidden,
              norm_topk_prob=moe.norm_topk_prob,
              kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
              qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
              rope_interleave=m.rope_interleaved, num_nextn_predict_layers=m.mtp_layers,
              n_routed_experts=moe.num_experts, n_shared_experts=moe.shared_experts,
              first_k_dense_replace=first, routed_scaling_factor=moe.routed_scaling_factor,
              n_group=moe.num_groups if grouped else 1, topk_group=moe.group_top_k if grouped else 1,
              scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1,
              **_deepseek_aux_to_hf(cfg))
    return hf


def _deepseek_v3_empty_tensors(cfg: Config) -> dict[str, tuple[int, ...]]:
    """With n_shared_experts=0 each MoE block (MTP's too) of transformers' DeepseekV3 holds a
    shared-experts MLP of width 0: nn.Linear weights [0, D] (gate, up) and [D, 0] (down)."""
    if cfg.moe.shared_experts:
        return {}
    D = cfg.model.dim
    shapes = {"ffn.shared.w1.weight": (0, D), "ffn.shared.w3.weight": (0, D), "ffn.shared.w2.weight": (D, 0)}
    moe_blocks = _moe_layer_ids(cfg, cfg.model.n_layers + cfg.model.mtp_layers)
    return {f"model.layers.{i}.{_SHARED[ours]}": shape for i in moe_blocks for ours, shape in shapes.items()}


# transformers 5's config classes' defaults of the keys read without one (every other key's default
# is the reader's own)
_QWEN3_MOE_DEFAULTS = dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
                           intermediate_size=6144, moe_intermediate_size=768, num_experts_per_tok=8, num_experts=128)
_MIXTRAL_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         intermediate_size=14336, num_experts_per_tok=2, num_local_experts=8)
_DEEPSEEK_V3_DEFAULTS = dict(vocab_size=129280, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
                             intermediate_size=18432, moe_intermediate_size=2048, num_experts_per_tok=8,
                             n_routed_experts=256, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                             v_head_dim=128)

# transformers 5's config fields typed without None, in every family (PreTrainedConfig's own aside)
_NON_NULL = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps", "use_cache",
             "tie_word_embeddings", "output_router_logits")

FAMILIES = {
    "qwen3_moe": Family("qwen3_moe", "Qwen3MoeForCausalLM", _QWEN3_MOE_BLOCK,
                        _qwen3_moe_from_hf, _qwen3_moe_to_hf,
                        keys={"moe.num_experts": _QWEN3_MOE_EXPERTS}, class_defaults=_QWEN3_MOE_DEFAULTS,
                        non_null=(*_NON_NULL, "num_key_value_heads", "attention_bias", "use_sliding_window",
                                  "attention_dropout", "decoder_sparse_step", "moe_intermediate_size",
                                  "num_experts_per_tok", "num_experts", "norm_topk_prob", "router_aux_loss_coef")),
    "mixtral": Family("mixtral", "MixtralForCausalLM", _MIXTRAL_BLOCK, _mixtral_from_hf, _mixtral_to_hf,
                      keys={"moe.num_experts": _MIXTRAL_EXPERTS, "moe.expert_hidden": ("intermediate_size",),
                            "moe.input_jitter": ("router_jitter_noise",)},
                      class_defaults=_MIXTRAL_DEFAULTS,
                      non_null=(*_NON_NULL, "num_key_value_heads", "attention_dropout", "num_experts_per_tok",
                                "num_local_experts", "router_aux_loss_coef", "router_jitter_noise")),
    "deepseek_v3": Family("deepseek_v3", "DeepseekV3ForCausalLM", _DEEPSEEK_V3_BLOCK,
                          _deepseek_v3_from_hf, _deepseek_v3_to_hf,
                          # first_k_dense_replace, n_group, topk_group, v_head_dim: its config takes null,
                          # its modeling compares i >= None, divides, tops-k or adds by it
                          non_null=(*_NON_NULL, "moe_intermediate_size", "n_shared_experts", "n_routed_experts",
                                    "routed_scaling_factor", "kv_lora_rank", "qk_rope_head_dim",
                                    "qk_nope_head_dim", "attention_bias", "num_mtp_layers", "first_k_dense_replace",
                                    "n_group", "topk_group", "v_head_dim"),
                          mtp=_DEEPSEEK_V3_MTP, mtp_copies=_DEEPSEEK_V3_MTP_COPIES,
                          empty_tensors=_deepseek_v3_empty_tensors, class_defaults=_DEEPSEEK_V3_DEFAULTS,
                          keep_fp32=(".mlp.gate.weight", ".mlp.gate.e_score_correction_bias"),
                          keys={"moe.num_experts": _DEEPSEEK_V3_EXPERTS, "moe.num_groups": ("n_group",),
                                "moe.group_top_k": ("topk_group",), "moe.first_k_dense": ("first_k_dense_replace",),
                                "moe.shared_experts": ("n_shared_experts",),
                                "moe.routed_scaling_factor": ("routed_scaling_factor",),
                                "moe.aux_loss_coeff": ("aux_loss_alpha",),
                                "moe.seq_aux_loss_coeff": ("aux_loss_alpha",),
                                "model.mtp_layers": ("num_nextn_predict_layers", "num_mtp_layers"),
                                **{f"model.{k}": (k,) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                                                "qk_rope_head_dim", "v_head_dim")}}),
}


def family_of(name: str, where: str) -> Family:
    if not isinstance(name, str) or name not in FAMILIES:  # a JSON list or object is unhashable
        raise CheckpointError(f"{where}={name!r} is not supported (supported: {', '.join(FAMILIES)})")
    return FAMILIES[name]
