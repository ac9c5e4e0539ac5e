"""Hugging Face checkpoints: import into and export from a moefold `Transformer`, per family
(Qwen3-MoE, Mixtral, DeepSeek-V3 with MLA, YaRN and MTP), one tensor at a time.

E experts, D model dim, F expert hidden, L main layers.

    cfg = config_from_hf(json.load(open("config.json")))      # and hf_config_from(cfg, vocab_size)
    model = load_pretrained("ckpt/Qwen3-30B-A3B", dtype=torch.bfloat16, device="cuda")  # a local directory
    save_pretrained(model, "out/", max_shard_bytes=5 * 2**30)
    cfg, step_0 = convert_to_run_checkpoint("ckpt/DeepSeek-V3", "runs/v3")  # out of core, to a run

A *plan* pairs every Hugging Face tensor name with the moefold tensor it fills (whole, or expert e
of a stacked `[E, in, out]` weight, transposed); both directions walk the same plan, so an import
that fills every tensor and an export that writes every tensor are one fact. The per-family name
tables and config converters are data in `hf_families.py`. The files are the Hub's layout:
`config.json` (and `generation_config.json`), `model.safetensors` or
`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`, per-expert tensors, MTP
module k as layer L+k with copies of the shared embedding and head.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moefold.checkpoint.hf_families import (FAMILIES, Family, PerExpert, Rule, config_json_keys, family_of,
                                            refuse_nulls, token_ids, with_class_defaults)
from moefold.config import Config, ModelConfig, validate
from moefold.errors import CheckpointError, ConfigError, writing
from moefold.files import fsync
from moefold.models.transformer import Transformer, build_model, materialize
from moefold.parallel.local import held_indices, local_tensor

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")

__all__ = ["config_from_hf", "checkpoint_config", "read_generation_config", "hf_config_from",
           "generation_config_from", "stop_token_ids", "check_exportable", "load_pretrained",
           "pretrained_on_meta", "fill_pretrained", "convert_to_run_checkpoint", "save_pretrained",
           "hf_tensors", "build_plan", "FAMILIES"]


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


def config_from_hf(hf_config: dict[str, Any]) -> Config:
    """The moefold `Config` of a Hugging Face config.json (model and MoE sections; the rest default).

    Raises CheckpointError naming the key and value of any option moefold cannot express."""
    family = family_of(_json_object(hf_config, CONFIG).get("model_type"), "config.json: model_type")
    refuse_nulls(family, hf_config)
    cfg = family.config_from_hf(with_class_defaults(family, hf_config))
    try:
        validate(cfg)
    except ConfigError as e:
        raise CheckpointError(_in_config_json_keys(str(e), config_json_keys(family, hf_config))) from None
    return cfg


_FIELD = re.compile(r"\b(?:model|moe)\.\w+")


def _in_config_json_keys(message: str, keys: dict[str, str]) -> str:
    """`validate`'s refusal of an imported config with its fields named by their config.json keys
    ('num_experts_per_tok=7 exceeds num_experts=6'); where one has no key (a field derived from
    several), the message says it is moefold's config."""
    named = _FIELD.sub(lambda m: keys.get(m.group(0), m.group(0)), message)
    if _FIELD.search(named):
        return f"config.json maps to an invalid moefold config: {named}"
    return f"config.json: {named}"


def checkpoint_config(path: str | Path) -> Config:
    """The moefold `Config` of checkpoint directory `path`: its config.json's (`config_from_hf`),
    with its generation_config.json (`read_generation_config`)."""
    cfg = config_from_hf(_read_json(Path(path) / CONFIG))
    read_generation_config(cfg.model, path)
    return cfg


# written by whichever transformers saved the file: not a setting, and not ours to claim
_GENERATION_BOOKKEEPING = ("eos_token_id", "transformers_version")


def read_generation_config(model: ModelConfig, path: str | Path) -> None:
    """Sets model.generation_config and model.generation_eos_token_ids from checkpoint directory
    `path`'s generation_config.json. transformers 5 reads the file as it is (GenerationConfig.
    from_pretrained): one without eos_token_id stops generate at none, config.json's ids are read
    only where there is no such file. Every other key is kept for the export, a value that is a
    JSON object (nothing transformers' generation options hold) refused by its key."""
    file = Path(path) / GENERATION_CONFIG
    if not file.is_file():
        model.generation_config, model.generation_eos_token_ids = "", []
        return
    content = _read_json(file)
    model.generation_eos_token_ids = token_ids(content.get("eos_token_id"), f"{GENERATION_CONFIG}: eos_token_id")
    settings = {key: value for key, value in content.items() if key not in _GENERATION_BOOKKEEPING}
    for key, value in settings.items():
        if not _is_json_list_or_scalar(value):
            raise CheckpointError(f"{GENERATION_CONFIG}: {key}={json.dumps(value)} is not supported "
                                  "(a number, string, boolean, null or a list of them)")
    model.generation_config = json.dumps(settings)


def _is_json_list_or_scalar(value: Any) -> bool:
    if isinstance(value, list):
        return all(_is_json_list_or_scalar(v) for v in value)
    return value is None or isinstance(value, (str, int, float))


def _has_generation_config(model: ModelConfig) -> bool:
    """Whether the imported checkpoint had a generation_config.json: its settings, or its eos ids
    alone (a config that sets model.generation_eos_token_ids without model.generation_config)."""
    return bool(model.generation_config or model.generation_eos_token_ids)


def stop_token_ids(cfg: Config, end_of_document: int | None) -> list[int]:
    """The ids generation stops at: those an imported checkpoint states (its generation_config.json's,
    none where that file states none; config.json's where there is no such file, as transformers'
    generate takes them) and `end_of_document`, the id that ended the run's training documents
    (None: none)."""
    m = cfg.model
    stated = m.generation_eos_token_ids if _has_generation_config(m) else m.eos_token_ids
    return stated + ([] if end_of_document is None or end_of_document in stated else [end_of_document])


def _json_ids(ids: list[int]) -> int | list[int] | None:
    """Token ids as config.json writes them: null for none, an integer for one, else a list."""
    return None if not ids else ids[0] if len(ids) == 1 else ids


def _json_single_id(ids: list[int], key: str) -> int | None:
    """model.bos_token_ids or pad_token_ids as config.json writes it: null or one integer."""
    if len(ids) > 1:
        raise CheckpointError(f"{key}={ids} cannot be exported: config.json takes one id or none")
    return _json_ids(ids)


def hf_config_from(cfg: Config, vocab_size: int, eos_token_id: int | None = None) -> dict[str, Any]:
    """The config.json of `cfg` for transformers (the Hub's keys: `rope_theta`/`rope_scaling`, which
    transformers 5 also reads). Raises CheckpointError for a setting the family cannot express.

    `eos_token_id`: the id that ended the training documents, where transformers' `generate` stops
    (it takes config.json's ids when there is no generation_config.json). config.json's eos_token_id
    is model.eos_token_ids (an imported checkpoint's config.json ids) and it; where the checkpoint
    had a generation_config.json (written back with it, `generation_config_from`, which
    transformers' generate reads instead), its ids as imported. Null when there are none:
    else the family's config class would give its own (DeepSeek-V3's 0 and 1, Mixtral's 1 and 2),
    ids of other tokens here. bos_token_id and pad_token_id are an imported checkpoint's, else
    null: moefold trains without a beginning-of-sequence or padding token.
    An `eos_token_id` outside [0, vocab_size) is a CheckpointError: no token of the model has it."""
    family = family_of(cfg.model.family, "model.family")
    if eos_token_id is not None and not 0 <= eos_token_id < vocab_size:
        raise CheckpointError(f"eos_token_id={eos_token_id} is not a token of the model's vocabulary "
                              f"(0..{vocab_size - 1})")
    hf = family.config_to_hf(cfg)
    m = cfg.model
    return {"architectures": [family.architecture], **hf, "vocab_size": vocab_size,
            "bos_token_id": _json_single_id(m.bos_token_ids, "model.bos_token_ids"),
            "pad_token_id": _json_single_id(m.pad_token_ids, "model.pad_token_ids"),
            "eos_token_id": _json_ids(_config_eos_ids(cfg, eos_token_id))}


def _config_eos_ids(cfg: Config, end_of_document: int | None) -> list[int]:
    """config.json's eos ids: with a generation_config.json (which transformers' generate reads
    instead), the imported ones as they were; else where generation stops."""
    m = cfg.model
    if _has_generation_config(m):
        return m.eos_token_ids or ([] if end_of_document is None else [end_of_document])
    return stop_token_ids(cfg, end_of_document)


def generation_config_from(cfg: Config, eos_token_id: int | None = None) -> dict[str, Any] | None:
    """The generation_config.json of `cfg`: an imported checkpoint's (model.generation_config),
    its eos_token_id the generation ids with `eos_token_id` (`hf_config_from`'s), absent where
    there are none; None where the checkpoint had no such file (transformers' generate then takes
    config.json's ids)."""
    m = cfg.model
    if not _has_generation_config(m):
        return None
    settings = _generation_settings(m.generation_config)
    ids = stop_token_ids(cfg, eos_token_id)
    return {**settings, "eos_token_id": _json_ids(ids)} if ids else settings


def _generation_settings(text: str) -> dict[str, Any]:
    """model.generation_config as the JSON object it holds ("": none); a config.toml edited into
    anything else is refused naming the field."""
    try:
        settings = json.loads(text or "{}")
    except ValueError:
        settings = None
    if not isinstance(settings, dict):
        raise CheckpointError(f"model.generation_config={text!r} is not a JSON object "
                              "(an imported checkpoint's generation_config.json settings)")
    return settings


def check_exportable(cfg: Config) -> None:
    """Refuses, as `save_pretrained` would, a config whose family or options a Hugging Face
    checkpoint cannot hold: from the config alone, before a model is built or its weights read."""
    family_of(cfg.model.family, "model.family").config_to_hf(cfg)
    _json_single_id(cfg.model.bos_token_ids, "model.bos_token_ids")
    _json_single_id(cfg.model.pad_token_ids, "model.pad_token_ids")
    _generation_settings(cfg.model.generation_config)


# ---------------------------------------------------------------------------------------------
# The plan: Hugging Face name → moefold tensor
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    ours: str
    """moefold state-dict name."""
    expert: int | None = None
    """Expert e of a stacked `[E, in, out]` weight, stored transposed `[out, in]`; None: the whole tensor."""


@dataclass
class Plan:
    tensors: dict[str, torch.Tensor]
    """moefold parameters and persistent buffers, one name per tensor (a tied head is an alias)."""
    slots: dict[str, Slot]
    """Every Hugging Face tensor of the checkpoint and the tensor it fills, in export order."""
    copies: dict[str, str]
    """HF names that duplicate a moefold tensor (MTP's embedding and head): equal on import, written."""
    aliases: dict[str, str]
    """HF names of tied moefold tensors (a tied `lm_head.weight`): optional, equal on import, not written."""
    fp32: frozenset[str] = frozenset()
    """moefold names of the tensors transformers holds in fp32 whatever the model's dtype (the
    family's `keep_fp32`): loaded, converted to a run and exported in fp32, by this one rule."""
    empties: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """HF name → shape of the zero-element tensors transformers holds where moefold holds none
    (the family's `empty_tensors`): optional on import, written on export in the parameters' dtype."""


def _hf_shape(t: torch.Tensor, expert: int | None) -> tuple[int, ...]:
    """The shape of `t` (or of its expert `expert`, transposed) in the checkpoint."""
    return tuple(t.shape) if expert is None else tuple(t.shape)[:0:-1]


# Scopes of moefold names: (pattern, table, HF prefix from the layer number). MTP module k's tensors
# live in HF layer L+k. Checked in order; the first match wins.
_SCOPES = (
    (re.compile(r"mtp\.(?:layers\.)?(\d+)\.block\.(.+)"), "block", lambda k, L: f"model.layers.{L + k}."),
    (re.compile(r"mtp\.(?:layers\.)?(\d+)\.(.+)"), "mtp", lambda k, L: f"model.layers.{L + k}."),
    (re.compile(r"layers\.(\d+)\.(.+)"), "block", lambda i, L: f"model.layers.{i}."),
    (re.compile(r"()(.+)"), "top", lambda _, L: ""),
)


def _rule(family: Family, ours: str, n_layers: int) -> tuple[str, Rule]:
    """(HF prefix, rule) of moefold tensor `ours`."""
    for pattern, table, prefix in _SCOPES:
        match = pattern.fullmatch(ours)
        if match:
            index, rest = match.groups()
            rule = getattr(family, table).get(rest)
            if rule is None:
                break
            return prefix(int(index or 0), n_layers), rule
    raise CheckpointError(f"moefold tensor {ours} has no Hugging Face name in the {family.model_type} "
                          "mapping (a model feature this family's checkpoints cannot hold)")


def _hf_names(family: Family, ours: str, tensor: torch.Tensor, n_layers: int) -> Iterator[tuple[str, Slot]]:
    prefix, rule = _rule(family, ours, n_layers)
    if isinstance(rule, PerExpert):
        for e in range(tensor.shape[0]):
            yield prefix + rule.hf.format(e=e), Slot(ours, e)
    else:
        yield prefix + rule, Slot(ours)


def build_plan(model: Transformer) -> Plan:
    """The Hugging Face tensors of `model` and where each lives in it."""
    family = family_of(model.cfg.model.family, "model.family")
    L = model.cfg.model.n_layers
    tensors, alias_of, seen = {}, {}, {}
    for name, t in model.state_dict(keep_vars=True).items():  # persistent buffers only
        first = seen.setdefault(id(t), name)
        if first == name:
            tensors[name] = t
        else:
            alias_of[name] = first
    slots = {hf: slot for name, t in tensors.items() for hf, slot in _hf_names(family, name, t, L)}
    aliases = {hf: alias_of[name] for name in alias_of
               for hf, _ in _hf_names(family, name, tensors[alias_of[name]], L)}
    copies = {f"model.layers.{L + k}.{hf}": alias_of.get(ours, ours)
              for k in range(model.cfg.model.mtp_layers) for hf, ours in family.mtp_copies.items()}
    keep = family.keep_fp32
    fp32 = frozenset(slot.ours for hf, slot in slots.items()
                     if hf.endswith(keep) and tensors[slot.ours].is_floating_point())
    return Plan(tensors, slots, copies, aliases, fp32, family.empty_tensors(model.cfg))


def hf_tensors(model: Transformer, source: dict[str, torch.Tensor] | None = None
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of every tensor the checkpoint holds, each built when reached.

    `source` replaces the model's tensors by name (e.g. `{n: p.grad for n, p in
    model.named_parameters()}` gives the gradients under Hub names)."""
    plan = build_plan(model)
    tensors = {**plan.tensors, **(source or {})}
    for hf, slot in plan.slots.items():
        yield hf, _to_hf_layout(tensors[slot.ours], slot.expert)
    for hf, ours in plan.copies.items():
        yield hf, tensors[ours].detach()
    empty_dtype = _parameter_dtype(plan)
    for hf, shape in plan.empties.items():
        yield hf, torch.empty(shape, dtype=empty_dtype)


def _parameter_dtype(plan: Plan) -> torch.dtype:
    """The dtype of the model's floating-point parameters (but the fp32 ones of `plan.fp32`)."""
    return next((t.dtype for name, t in plan.tensors.items()
                 if isinstance(t, nn.Parameter) and t.is_floating_point() and name not in plan.fp32), torch.float32)


def _to_hf_layout(t: torch.Tensor, expert: int | None) -> torch.Tensor:
    t = t.detach()
    return t if expert is None else t[expert].T


# ---------------------------------------------------------------------------------------------
# Import
# ---------------------------------------------------------------------------------------------


def load_pretrained(path: str | Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu", cfg: Config | None = None) -> Transformer:
    """The moefold model of a Hugging Face checkpoint directory, in eval mode.

    Parameters are `dtype`, but for those transformers holds in fp32 in any dtype (the family's
    `keep_fp32`: DeepSeek-V3's router weight); buffers such as the expert bias keep fp32. The
    model is built on the meta device and materialised once on `device`, then filled one tensor
    at a time. Every checkpoint tensor must map to the model and every model tensor must be
    filled, else CheckpointError names them. `cfg`: as `pretrained_on_meta`'s."""
    model = pretrained_on_meta(path, torch.device(device).type, dtype, cfg)
    materialize(model, torch.device(device), dtype)  # buffers zero, weights filled next
    _keep_fp32(model)
    fill_pretrained(model, path)
    return model.eval()


def _keep_fp32(model: Transformer) -> None:
    """The tensors of the family's `keep_fp32` in fp32, as transformers' `from_pretrained` holds
    them in a bf16 or fp16 model (the router reads its weight in fp32 either way)."""
    plan = build_plan(model)
    for ours in plan.fp32:
        t = plan.tensors[ours]
        if t.dtype != torch.float32:
            t.data = t.data.float()


def pretrained_on_meta(path: str | Path, device_type: str = "cpu", dtype: torch.dtype = torch.float32,
                       cfg: Config | None = None) -> Transformer:
    """The model of checkpoint directory `path` on the meta device, its tensor names checked against
    the checkpoint's: `materialize` it (or parallelize it first, then materialize its pieces), then
    `fill_pretrained`. `device_type` and `dtype` pick the experts backend, as in `build_model`.

    `cfg`: build the model from this config (config.json's [model] and [moe] with a run's
    overrides, `train --init-from-hf`) instead of config.json's own; an override that changes a
    tensor's shape is a ConfigError naming it. Where the checkpoint has no MTP tensors, its
    model.mtp_layers is set to 0, as the model is built."""
    path = Path(path)
    own_cfg = checkpoint_config(path)
    file_of = _tensor_files(path)
    _drop_absent_mtp(own_cfg, file_of)
    if cfg is not None:
        _drop_absent_mtp(cfg, file_of)
    model_cfg = cfg or own_cfg
    with torch.device("meta"):
        model = build_model(model_cfg, model_cfg.model.vocab_size, device_type, dtype)
        if cfg is not None:
            _refuse_other_shapes(model, build_model(own_cfg, own_cfg.model.vocab_size, device_type, dtype), path)
    _check_names(build_plan(model), file_of, path)  # before any memory is allocated
    return model


def fill_pretrained(model: Transformer, path: str | Path) -> None:
    """Fill `model` (from `pretrained_on_meta`, materialized: whole tensors, or a parallelized
    model's DTensor pieces) with checkpoint directory `path`'s tensors."""
    path = Path(path)
    _fill(build_plan(model), _tensor_files(path), path)


SCRATCH = ".convert-tmp"
"""Directory of a run that holds `convert_to_run_checkpoint`'s file-backed tensors while it works."""


def convert_to_run_checkpoint(path: str | Path, run_dir: str | Path, dtype: torch.dtype = torch.float32
                              ) -> tuple[Config, Path]:
    """Write the Hugging Face checkpoint directory `path` as the weights-only step-0 checkpoint of
    run directory `run_dir`; return (its config, the checkpoint directory).

    The checkpoint is the one `save_weights_only(load_pretrained(path, dtype).state_dict(), run_dir)`
    writes (a `torch.distributed.checkpoint` directory with "model" and "step": 0), but the model is
    never held in memory: it is built on the meta device for its names, shapes and dtypes, each
    tensor gets storage in a file of `run_dir/.convert-tmp` (a shared mapping, whose pages the kernel
    writes back and evicts rather than needing RAM), the checkpoint's tensors are copied in one at a
    time and DCP writes the result through the usual atomic save. Memory in use beyond the page
    cache is about one checkpoint tensor, so a checkpoint larger than host memory converts (the
    disk holding `run_dir` needs room for the model twice while it runs).

    The scratch files are removed whatever happens; on an error, so is what this call created in
    `run_dir` (the directory itself, or its `checkpoints/`). Callers check that `run_dir` holds no
    run: as a step-0 save it replaces earlier checkpoints."""
    from moefold.checkpoint.dcp import CHECKPOINTS, save_weights_only

    path, run_dir = Path(path), Path(run_dir)
    cfg = checkpoint_config(path)
    file_of = _tensor_files(path)
    _drop_absent_mtp(cfg, file_of)
    with torch.device("meta"):
        model = build_model(cfg, cfg.model.vocab_size, "cpu", dtype)
    plan = build_plan(model)
    _check_names(plan, file_of, path)  # before anything is written
    created = not run_dir.exists()
    had_checkpoints = (run_dir / CHECKPOINTS).exists()
    scratch = run_dir / SCRATCH
    shutil.rmtree(scratch, ignore_errors=True)  # leftover of an interrupted conversion
    try:
        scratch.mkdir(parents=True)
        state = _file_backed_state(model, dtype, scratch)
        _fill(replace(plan, tensors={name: state[name] for name in plan.tensors}), file_of, path)
        checkpoint = save_weights_only(state, run_dir)
    except BaseException:
        if created:
            shutil.rmtree(run_dir, ignore_errors=True)
        elif not had_checkpoints:
            shutil.rmtree(run_dir / CHECKPOINTS, ignore_errors=True)
        raise
    finally:
        state = plan = None  # unmap before deleting the files
        shutil.rmtree(scratch, ignore_errors=True)
    return model.cfg, checkpoint


def _file_backed_state(model: nn.Module, dtype: torch.dtype, scratch: Path) -> dict[str, torch.Tensor]:
    """The state dict of meta-device `model` (what `load_pretrained` materialises: floating-point
    parameters in `dtype`, buffers in their own dtype, tied tensors one tensor), each tensor a shared
    mapping of its own file in `scratch`. One file per tensor: DCP writes a tensor that does not span
    its whole storage through a copy. The plan's `fp32` tensors are fp32, as `load_pretrained` holds them."""
    fp32 = build_plan(model).fp32
    state: dict[str, torch.Tensor] = {}
    made: dict[int, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in made:
            t_dtype = dtype if isinstance(t, nn.Parameter) and t.is_floating_point() else t.dtype
            t_dtype = torch.float32 if name in fp32 else t_dtype
            if t.numel() == 0:
                made[id(t)] = torch.empty(t.shape, dtype=t_dtype)
            else:
                file = scratch / f"{len(made):06d}.bin"
                made[id(t)] = torch.from_file(str(file), shared=True, size=t.numel(),
                                              dtype=t_dtype).view(t.shape)
        state[name] = made[id(t)]
    return state


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file (not a Hugging Face checkpoint directory?)")
    try:
        return _json_object(json.loads(path.read_text()), path)
    except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError: not UTF-8 (a UTF-16 editor's)
        raise CheckpointError(f"{path}: invalid JSON: {e}") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None


def _json_object(value: Any, path: Path | str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: not a JSON object (a JSON {type(value).__name__})")
    return value


def _tensor_files(path: Path) -> dict[str, Path]:
    """Every tensor name of the checkpoint and its safetensors file. Beside model.safetensors (which
    transformers loads first), an index whose shards are gone is a leftover (transformers' save as
    one file removes the shards, not the index); one with all its shards makes the checkpoint
    ambiguous, a CheckpointError."""
    single = (path / SINGLE).is_file()
    if (path / INDEX).is_file():
        weight_map = _read_json(path / INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{path / INDEX}: no weight_map")
        for name, file in weight_map.items():
            if not isinstance(file, str):
                raise CheckpointError(f"{path / INDEX}: weight_map maps {name} to {json.dumps(file)}, not a file name")
        absent = [file for file in sorted(set(weight_map.values())) if not (path / file).is_file()]
        if single and not absent:
            raise CheckpointError(f"{path}: holds both {SINGLE} and {INDEX} with its shards (one is left over "
                                  "from an earlier save); remove the one that is not this checkpoint "
                                  f"(transformers loads {SINGLE})")
        if absent and not single:
            raise CheckpointError(f"{path / INDEX} names {absent[0]}, which does not exist")
        if not single:
            return {name: path / file for name, file in weight_map.items()}
    if single:
        with _safetensors_file(path / SINGLE) as f:
            return dict.fromkeys(f.keys(), path / SINGLE)
    raise CheckpointError(f"{path}: neither {SINGLE} nor {INDEX} (only safetensors checkpoints load)")


def _refuse_other_shapes(model: nn.Module, own: nn.Module, path: Path) -> None:
    """The model a run's config builds against the one config.json builds: the same tensors, of the
    same shapes, tied alike (the overrides changed only what holds no weight)."""
    tied, held = model.cfg.model.tie_embeddings, own.cfg.model.tie_embeddings
    if tied != held:  # same shapes: else blamed on the checkpoint once the model is allocated
        raise ConfigError(f"--init-from-hf {path}: model.tie_embeddings={tied}, its config.json "
                          f"tie_word_embeddings={json.dumps(held)}; override only what keeps the checkpoint's tensors")
    ours = {name: list(t.shape) for name, t in model.state_dict().items()}
    theirs = {name: list(t.shape) for name, t in own.state_dict().items()}
    for name in sorted(ours.keys() | theirs.keys()):
        if ours.get(name) != theirs.get(name):
            raise ConfigError(f"--init-from-hf {path}: the overridden model.*/moe.* give {name} "
                              f"{ours.get(name) or 'no tensor'}, its config.json {theirs.get(name) or 'no tensor'}; "
                              "override only what keeps the checkpoint's shapes")


def _drop_absent_mtp(cfg: Config, file_of: dict[str, Path]) -> None:
    """transformers' DeepseekV3 has no MTP layer: its save writes num_nextn_predict_layers (its
    config's default 1) but no layer-L tensors, and its load builds none. Such a checkpoint loads
    without MTP modules, silently, as there. Partly present MTP layers stay an error (missing tensors)."""
    if cfg.model.mtp_layers and not _holds_mtp(cfg, file_of):
        cfg.model.mtp_layers = 0


def _holds_mtp(cfg: Config, file_of: dict[str, Path]) -> bool:
    first_mtp = f"model.layers.{cfg.model.n_layers}."
    return any(name.startswith(first_mtp) for name in file_of)


def refuse_absent_mtp(path: str | Path, cfg: Config) -> None:
    """Refuses the model.mtp_layers > 0 a user asked for (`train --init-from-hf --model.mtp_layers`)
    where checkpoint `path` holds no MTP tensors: `pretrained_on_meta` would drop the modules, as
    for config.json's own value, and the run train without the MTP loss it asked for. No module
    the checkpoint lacks starts fresh (an override that changes a tensor is refused too)."""
    if cfg.model.mtp_layers and not _holds_mtp(cfg, _tensor_files(Path(path))):
        raise ConfigError(f"--model.mtp_layers {cfg.model.mtp_layers}: --init-from-hf {path} holds no MTP "
                          f"tensors (model.layers.{cfg.model.n_layers}.*) to start them from; leave "
                          "--model.mtp_layers out to train without MTP")


def _check_names(plan: Plan, file_of: dict[str, Path], path: Path) -> None:
    known = plan.slots.keys() | plan.copies.keys() | plan.aliases.keys() | plan.empties.keys()
    unknown = [f"{name} (in {file.name})" for name, file in file_of.items() if name not in known]
    missing = [f"{name} (for {slot.ours})" for name, slot in plan.slots.items() if name not in file_of]
    problems = []
    if unknown:
        problems.append(f"{len(unknown)} tensor(s) with no place in the model: {_names(unknown)}")
    if missing:
        problems.append(f"{len(missing)} tensor(s) the model needs are missing: {_names(missing)}")
    if problems:
        raise CheckpointError(f"checkpoint {path}: " + "; ".join(problems))
    _check_shapes(plan, file_of, path)


def _check_shapes(plan: Plan, file_of: dict[str, Path], path: Path) -> None:
    """Every tensor's shape from its file's header, before anything is read: each rank of a
    parallel run reads only its own rows and experts, yet all refuse a bad checkpoint alike. The
    names checked are those read from the file: an index can send a tensor to a shard without it."""
    repeated = {**plan.aliases, **plan.copies}
    names_in: dict[Path, list[str]] = {}
    for name, file in file_of.items():
        names_in.setdefault(file, []).append(name)
    for file in sorted(names_in):
        with _safetensors_file(file) as f:
            held = set(f.keys())
            absent = [name for name in names_in[file] if name not in held]
            if absent:
                raise CheckpointError(f"{path / INDEX} puts {_names(absent)} in {file.name}, which "
                                      f"does not hold {'it' if len(absent) == 1 else 'them'} (an index out "
                                      "of date with its shards: download or copy them again)")
            for name in names_in[file]:
                slot = plan.slots.get(name) or (Slot(repeated[name]) if name in repeated else None)
                shape = tuple(f.get_slice(name).get_shape())
                if slot is not None:
                    _check_shape(_hf_shape(plan.tensors[slot.ours], slot.expert), name, shape, file)
                elif name in plan.empties:
                    _check_shape(plan.empties[name], name, shape, file)


def _names(names: list[str], limit: int = 12) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


@torch.no_grad()
def _fill(plan: Plan, file_of: dict[str, Path], path: Path) -> None:
    """Every moefold tensor of `plan` from its checkpoint tensors, one tensor at a time, each
    reading only what this rank's piece holds: a DTensor's expert rows of dim 0 and its cuts of
    the other dimensions (FSDP's, TP's), so that no rank reads, or holds on the host, more than
    its piece. The checkpoint's duplicates (MTP's copies, a tied head) must equal what they repeat."""
    hf_of: dict[str, list[str]] = {}
    for hf, slot in plan.slots.items():
        hf_of.setdefault(slot.ours, []).append(hf)
    repeats: dict[str, list[str]] = {}
    for hf in file_of:
        if hf in plan.copies or hf in plan.aliases:
            repeats.setdefault(plan.copies.get(hf) or plan.aliases[hf], []).append(hf)
    for ours, target in plan.tensors.items():
        held = held_indices(target)
        part = local_tensor(target)  # filled in place, on its device: staging on the host is slower
        row_of_expert = None if held[0] is None else {int(e): i for i, e in enumerate(held[0].tolist())}
        with _reading(file_of) as read:
            for hf in hf_of.get(ours, ()):
                expert = plan.slots[hf].expert
                if expert is None:
                    part.copy_(_read_held(read, hf, held))
                elif row_of_expert is None or expert in row_of_expert:  # else another rank's
                    row = expert if row_of_expert is None else row_of_expert[expert]
                    # expert e of [E, in, out] is stored [out, in]: its held rows are HF's columns
                    part[row].copy_(_read_held(read, hf, held[:0:-1]).T)
            for hf in repeats.get(ours, ()):
                src = _read_held(read, hf, held).to(part.device, part.dtype)  # shapes: _check_shapes
                if not torch.equal(src, part):
                    original = next(name for name, slot in plan.slots.items() if slot == Slot(ours))
                    raise CheckpointError(f"checkpoint {path}: {hf} must equal {original}, the shared "
                                          "tensor it duplicates, but differs")


def _read_held(read: Callable[..., torch.Tensor], name: str,
               held: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """`whole[ix_(*held)]` of checkpoint tensor `name` (held: per dimension the indices wanted, in
    order; None: all), reading only the box from each dimension's first index to its last."""
    box = tuple(slice(None) if ids is None else _span(ids) for ids in held)
    t = read(name, box if any(ids is not None for ids in held) else None)
    for dim, ids in enumerate(held):
        if ids is not None and len(ids) and not _is_range(ids):  # strided or out of order
            t = t.index_select(dim, ids - ids.min())
    return t


def _span(ids: torch.Tensor) -> slice:
    return slice(0, 0) if len(ids) == 0 else slice(int(ids.min()), int(ids.max()) + 1)


def _is_range(ids: torch.Tensor) -> bool:
    """Whether `ids` run on by one from their first (so the span is what they want, in order)."""
    return bool((ids.diff() == 1).all()) if len(ids) > 1 else True


@contextmanager
def _reading(file_of: dict[str, Path]) -> Iterator[Callable[..., torch.Tensor]]:
    """`read(name, box=None)`: a checkpoint tensor (or the box of it a tuple of slices names),
    from its file, opened once in the block. The files are closed when it ends: the pages of a
    mapped file count as the process's memory until then."""
    with ExitStack() as stack:
        opened: dict[Path, Any] = {}

        def read(name: str, box: tuple[slice, ...] | None = None) -> torch.Tensor:
            file = file_of[name]
            if file not in opened:
                opened[file] = stack.enter_context(_safetensors_file(file))
            return opened[file].get_tensor(name) if box is None else opened[file].get_slice(name)[box]

        yield read


@contextmanager
def _safetensors_file(file: Path) -> Iterator[Any]:
    """`safe_open(file)` on the CPU; a file safetensors cannot read (cut short by a failed
    download or copy, or not safetensors at all) or cannot open is a CheckpointError naming it,
    not a traceback."""
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError:  # an [hf] extra: `pip install -e .` leaves it out (export needs none)
        raise CheckpointError(f"{file}: reading it needs the `safetensors` package "
                              "(pip install 'moefold[hf]')") from None

    try:
        f = safe_open(file, framework="pt", device="cpu")
    except SafetensorError as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e}); download or copy it again") from None
    except OSError as e:  # not opened (permission denied): safetensors gives the OS's words, no errno
        raise CheckpointError(f"{file}: cannot be read ({e.strerror or e})") from None
    with f:
        yield f


def _check_shape(expected: tuple[int, ...], name: str, shape: tuple[int, ...], file: Path) -> None:
    if shape != expected:
        raise CheckpointError(f"{file.name}: {name} has shape {list(shape)}, the model expects "
                              f"{list(expected)}")


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------


def save_pretrained(model: Transformer, path: str | Path, max_shard_bytes: int = 5 * 2**30,
                    dtype: torch.dtype | None = None, copies: dict[str, Path] | None = None,
                    eos_token_id: int | None = None) -> None:
    """Write `model` as a Hugging Face checkpoint that transformers' `from_pretrained` loads:
    config.json and safetensors shards of at most `max_shard_bytes` (one tensor may exceed it),
    with an index when there is more than one. Tensors are built and written one at a time.

    `dtype` (float32, bfloat16 or float16; None: as the model holds them) casts the parameters, as
    transformers' `from_pretrained(dtype=...)` then `save_pretrained` would write them: buffers
    such as the expert bias keep theirs, and the tensors transformers holds in fp32 in any dtype
    (the family's `keep_fp32`: DeepSeek-V3's router weight and `e_score_correction_bias`) are
    written in fp32; a weight beyond fp16's range is a CheckpointError. config.json's
    `dtype` and `torch_dtype` are the parameters' dtype. Earlier `model*.safetensors` files, index and config
    in `path` are replaced, all at once: every file is written under a `.partial-` name first and
    renamed only when all are, so a failed export (a full disk) leaves `path` as it was, without a
    truncated shard to load.
    `copies` (name in `path` -> file) go with them: the run's tokenizer. `eos_token_id`: where
    generation stops (`hf_config_from`'s); an imported checkpoint's generation ids are written
    in a generation_config.json with it (`generation_config_from`)."""
    hf = hf_config_from(model.cfg, model.vocab_size, eos_token_id)  # first: fails on what the family cannot hold
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise CheckpointError(f"save_pretrained: dtype {dtype} is not one transformers loads a checkpoint in "
                              f"({', '.join(_dtype_name(d) for d in EXPORT_DTYPES)})")
    path = Path(path)
    created = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    plan = build_plan(model)
    entries = list(_export_entries(plan, dtype))
    shards = _assign_shards(entries, max_shard_bytes)
    # transformers >= 4.56 reads (and writes) `dtype`, keeping it over `torch_dtype`; earlier
    # versions and tools reading config.json's raw keys know only `torch_dtype`: both, one value.
    hf["dtype"] = hf["torch_dtype"] = _dtype_name(dtype or model.tok_embeddings.weight.dtype)
    writes: dict[str, Callable[[Path], Any]] = {}
    generation = generation_config_from(model.cfg, eos_token_id)
    if generation is not None:
        writes[GENERATION_CONFIG] = lambda file: file.write_text(json.dumps(generation, indent=2) + "\n")
    writes.update({file: partial(_write_safetensors, entries=shard) for file, shard in shards.items()})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(e.nbytes for e in entries)},
                 "weight_map": {e.name: file for file, shard in shards.items() for e in shard}}
        writes[INDEX] = lambda file: file.write_text(json.dumps(index, indent=2) + "\n")
    writes[CONFIG] = lambda file: file.write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    for name, source in (copies or {}).items():
        writes[name] = partial(shutil.copyfile, source)
    _write_all_or_nothing(path, writes, created)


def _write_all_or_nothing(path: Path, writes: dict[str, Callable[[Path], Any]], created: bool) -> None:
    """Each `writes[name](file)` into `path/.partial-<name>`, flushed to disk; then earlier shards
    and index go, the partial files take their names and `path` is flushed, as a checkpoint's
    rename is (`files.fsync`: else a power cut soon after could leave a name on an empty file).
    On a failed write the partial files go (and `path`, if this export created it); an OSError
    becomes an OutputError naming the file it was writing, or `path` once they are written."""
    partials = {name: path / f".partial-{name}" for name in writes}
    try:
        for name, write in writes.items():
            with writing(path / name):
                write(partials[name])
                fsync(partials[name])
    except BaseException:
        for file in partials.values():
            file.unlink(missing_ok=True)
        if created and not any(path.iterdir()):
            path.rmdir()
        raise
    with writing(path):
        for old in path.iterdir():
            if (_SHARD.match(old.name) or old.name in (INDEX, GENERATION_CONFIG)) and old.name not in writes:
                old.unlink()
        for name, file in partials.items():
            os.replace(file, path / name)
        fsync(path)


@dataclass(frozen=True)
class _Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


EXPORT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes `save_pretrained` writes parameters in: those of transformers' `from_pretrained`."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _export_entries(plan: Plan, dtype: torch.dtype | None) -> Iterator[_Entry]:
    params = {id(t) for t in plan.tensors.values() if isinstance(t, nn.Parameter)}

    def entry(name: str, ours: str, expert: int | None) -> _Entry:
        t = plan.tensors[ours]
        out_dtype = t.dtype
        if ours in plan.fp32:
            out_dtype = torch.float32
        elif dtype is not None and id(t) in params and t.is_floating_point():
            out_dtype = dtype
        return _Entry(name, _hf_shape(t, expert), out_dtype,
                      lambda: _cast(_to_hf_layout(t, expert), out_dtype, name))

    for name, slot in plan.slots.items():
        yield entry(name, slot.ours, slot.expert)
    for name, ours in plan.copies.items():
        yield entry(name, ours, None)
    empty_dtype = dtype or _parameter_dtype(plan)
    for name, shape in plan.empties.items():
        yield _Entry(name, shape, empty_dtype, partial(torch.empty, shape, dtype=empty_dtype))


def _cast(t: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """`t` on the CPU in `dtype`; a value beyond fp16's range (65504) is refused: it would be inf."""
    out = t.to("cpu", dtype).contiguous()
    if dtype == torch.float16 and t.dtype != dtype and not torch.isfinite(out).all():
        largest = t.abs().nan_to_num(0.0, 0.0, 0.0).max().item()  # an inf of the model's own stays
        if largest > torch.finfo(dtype).max:
            raise CheckpointError(f"{name} holds {largest:.6g}, beyond float16's range (largest "
                                  f"{torch.finfo(dtype).max:g}); export it in bfloat16 or float32")
    return out


def _assign_shards(entries: list[_Entry], max_shard_bytes: int) -> dict[str, list[_Entry]]:
    groups: list[list[_Entry]] = [[]]
    size = 0
    for e in entries:
        if groups[-1] and size + e.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += e.nbytes
    if len(groups) == 1:
        return {SINGLE: groups[0]}
    n = len(groups)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": g for i, g in enumerate(groups)}


_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
              torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
              torch.float8_e5m2: "F8_E5M2"}


def _write_safetensors(file: Path, entries: list[_Entry]) -> None:
    """One safetensors file, tensor by tensor. safetensors' own `save_file` takes a dict of every
    tensor of the file, which for transposed expert weights means a shard's worth of copies in
    memory; the format (8-byte header length, JSON header, raw little-endian data in header order)
    lets us write each tensor as it is built. Files are read back with `safetensors.safe_open`."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": _ST_DTYPES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for e in entries:
            t = e.make()
            assert tuple(t.shape) == e.shape and t.dtype == e.dtype, e.name
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)
