"""The training loop: data → model → loss → backward → optimizer, with logging, validation and
checkpoints at fixed step intervals.

`Trainer(cfg, run_dir, resume)` does every check that can fail on user input (config, data,
checkpoint) before it writes anything into the run directory.
"""

import contextlib
import dataclasses
import math
import os
import signal
import time
import tomllib
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from tqdm import tqdm

from moefold.checkpoint.dcp import (
    checkpoint_keys,
    checkpoint_step,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    load_weights,
    resolve_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from moefold.checkpoint.run_config import CONFIG_KEY, saved_config_text, unvalidated_config
from moefold.config import (Config, ParallelConfig, config_from_toml, micro_batches_per_step,
                            refuse_unsupported_parallel, to_toml, validate)
from moefold.data.corpus import build_token_streams, stream_fingerprint
from moefold.data.loader import IGNORE_INDEX, Batch, PackedSequences, TrainLoader, val_batch_rows, val_batches
from moefold.data.tokenizer import build_tokenizer, model_vocab_size
from moefold.errors import CheckpointError, ConfigError, TrainingDiverged, refuse_unwritable_dir
from moefold.files import write_atomically
from moefold.fp8.apply import apply_fp8
from moefold.fp8.weight_cache import refresh_weight_caches
from moefold.models.mtp import loss_or_zero
from moefold.models.transformer import Transformer, build_model, materialize
from moefold.moe.stats import AUX_SUM, ENTROPY_SUM, ENTROPY_TOKENS, summarize
from moefold.optim.adamw import GRAD_DTYPES, build_optimizer, clip_scaling
from moefold.optim.schedule import build_scheduler
from moefold.parallel.apply import parallelize
from moefold.parallel.data import DataParallel, GradNormClipper
from moefold.parallel.launch import TRAIN_LAUNCH, join
from moefold.plan.fit import rank_capacity, refuse_model_beyond_memory
from moefold.plan.refuse import refuse_weight_cache_over_fsdp
from moefold.train import metrics
from moefold.train.compile import compile_blocks
from moefold.train.flops import count_params, params_line, peak_tflops, train_flops_per_token
from moefold.train.heatmap import append_window, write_load_heatmap
from moefold.train.loss import build_head_loss, build_objective
from moefold.train.run_lock import LOCK_FILE, RunDirLock, refuse_run_dir_in_use
from moefold.train.step_data import StepBatches, read_agreed
from moefold.train.stop import StopVote


class TrainingInterrupted(Exception):
    """Raised after SIGINT/SIGTERM once the checkpoint is saved; the CLI exits with 128 + signal."""

    def __init__(self, signum: int, step: int, checkpoint: Path):
        super().__init__(f"interrupted by {signal.Signals(signum).name} at step {step}; "
                         f"checkpoint saved to {checkpoint}")
        self.signum = signum


def resolve_compute_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def _materialize_and_fill(model: Transformer, device: torch.device,
                          fill: Callable[[Transformer], None]) -> None:
    """Storage on `device` for a model on the meta device (only this rank's shards, once it is
    parallelized), then `fill` its weights: the rank's piece of each, drawn or read alone, the same
    values in every device and layout."""
    materialize(model, device)
    fill(model)


def _checkpoint_fill(path: Path, full_state: bool) -> Callable[[Transformer], None]:
    """How a resumed model's weights start. A weights-only checkpoint (a converted model) is the
    weights the optimizer starts from: loaded before it is built, so that precision-aware masters
    split the checkpoint's fp32 values as they split fresh ones. A full checkpoint (`full_state`)
    replaces weights and optimizer states once the optimizer exists (`Trainer._load`): until then,
    zeros, not a draw of the whole model to be overwritten."""
    return _zero_weights if full_state else partial(load_weights, path=path)


@torch.no_grad()
def _zero_weights(model: nn.Module) -> None:
    for p in model.parameters():
        p.zero_()


def _saving_run_config(checkpoint: Path) -> tuple[Config | None, str]:
    """The config `checkpoint` was saved with, read once for the resume checks, and where from in
    words: the one it holds; else (a checkpoint of an earlier version) its run's config.toml, which
    holds the options of the run's latest resume, not necessarily this checkpoint's; None where it
    has neither (a checkpoint copied out of its run)."""
    if (text := saved_config_text(checkpoint)) is not None:
        saved = unvalidated_config(tomllib.loads(text), f"checkpoint {checkpoint}")
        return saved, f"the config {checkpoint} was saved with"
    saved_config = checkpoint.parent.parent / "config.toml"
    return (config_from_toml(saved_config) if saved_config.is_file() else None), str(saved_config)


def _refuse_changed_state_dtypes(cfg: Config, saved: Config, checkpoint: Path) -> None:
    """A full checkpoint resumes with the optimizer states it saved, so in their dtypes: those of
    the config of the run that saved it (`saved`; the optimizer and its state layout follow them)."""
    for key in ("exp_avg_dtype", "exp_avg_sq_dtype", "master_dtype"):
        given, held = getattr(cfg.optim, key), getattr(saved.optim, key)
        if given != held:
            raise ConfigError(f"optim.{key}={given!r}, but {checkpoint} holds the optimizer states of "
                              f"optim.{key}={held!r}: a run resumes with the states it saved; keep optim.{key}")


def _changed_model_options(cfg: Config, saved: Config) -> list[str]:
    """'moe.top_k 2 -> 3' for each model.* and moe.* value a resume changes from the run it
    continues. Allowed where the weights still fit (routing, capacity, the aux losses) and said:
    the run then trains another model than its checkpoint's."""
    changed = []
    for section in ("model", "moe"):
        given, held = dataclasses.asdict(getattr(cfg, section)), dataclasses.asdict(getattr(saved, section))
        changed += [f"{section}.{key} {held[key]!r} -> {value!r}" for key, value in given.items()
                    if value != held[key]]
    return changed


def _refuse_changed_ties(cfg: Config, saved: Config, checkpoint: Path, full_state: bool) -> None:
    """A checkpoint holds tok_embeddings.weight and output.weight whether the run tied them or not:
    a model that ties what the saving run (`saved`) kept apart would load both into its one tensor,
    the embedding silently replaced by the output head (a weights-only checkpoint raised nothing).
    Untying a tied run's weights loads the same values into both and is left alone; its optimizer
    states (`full_state`) are one tensor's, which the optimizer's load refused as a corrupt file."""
    given, held = cfg.model.tie_embeddings, saved.model.tie_embeddings
    if given and not held:
        raise ConfigError(f"model.tie_embeddings=True, but {checkpoint} was saved by a run with "
                          "model.tie_embeddings=False, which holds the embedding and the output head apart: "
                          "a run continues with the model.* and moe.* it was trained with")
    if held and not given and full_state:
        raise ConfigError(f"model.tie_embeddings=False, but {checkpoint} was saved by a run with "
                          "model.tie_embeddings=True, whose optimizer holds one state for the embedding and the "
                          "output head together: a run continues with the model.* and moe.* it was trained "
                          "with; keep model.tie_embeddings=True")


def _refuse_other_data_order(saved: dict[str, int], given: dict[str, int], checkpoint: Path) -> None:
    """A checkpoint's data position (epoch, cursor) points into its run's training sequences in
    its seeded order; over other sequences or another order it would silently repeat some and skip
    others (the loader's own check catches only a position past the end)."""
    for key in ("seed", "seq_len"):
        if int(saved[key]) != given[key]:
            raise ConfigError(f"train.{key}={given[key]}, but {checkpoint} was saved with train.{key}={saved[key]}, "
                              f"the data order its position counts in: a run continues in its order; keep train.{key}")
    if int(saved["sequences"]) != given["sequences"]:
        raise ConfigError(f"the training data holds {given['sequences']} sequences, but {checkpoint} holds a data "
                          f"position among {saved['sequences']}: data.path, data.tokenizer or data.val_fraction "
                          "changed since it was saved; a run continues with the data it was trained with")


def _refuse_other_data(saved_fingerprint: int, given_fingerprint: int, checkpoint: Path) -> None:
    """As many sequences (`_refuse_other_data_order`), other ids: the files under data.path were
    replaced, or the tokenizer encodes alike in length only."""
    if int(saved_fingerprint) != given_fingerprint:
        raise ConfigError(f"the training data's ids differ from those {checkpoint} was trained on (as many "
                          "sequences, other tokens): the files under data.path or data.tokenizer changed since "
                          "it was saved; a run continues with the data it was trained with")


def _with_absolute_data_paths(cfg: Config) -> Config:
    """`cfg` with data.path and data.tokenizer absolute, for the run's config.toml: `--resume`,
    `generate` and `convert` read it from wherever they are started."""
    d = cfg.data
    return dataclasses.replace(cfg, data=dataclasses.replace(
        d, path=d.path and os.path.abspath(d.path), tokenizer=d.tokenizer and os.path.abspath(d.tokenizer)))


def _same_dir(a: Path, b: Path) -> bool:
    return a.is_dir() and b.is_dir() and os.path.samefile(a, b)


def run_dir_holds_run(run_dir: Path) -> bool:
    return (run_dir / "config.toml").exists() or (run_dir / "checkpoints").exists()


_RUN_DIR_ENTRIES = {"config.toml": "file", "metrics.jsonl": "file", metrics.SUPERSEDED_FILE: "file", LOCK_FILE: "file",
                    "checkpoints": "directory", "tb": "directory"}
"""What the trainer writes in a run directory, and of which kind."""


def refuse_run_dir(run_dir: Path, resumed: Path | None = None) -> None:
    """--run-dir checked before any work: writable, not in use by another training, its entries of
    the kinds the run writes (a directory named metrics.jsonl failed mid-start with a traceback),
    and free of another run (`_refuse_mixed_runs`)."""
    refuse_unwritable_dir(run_dir)
    refuse_run_dir_in_use(run_dir)
    for name, kind in _RUN_DIR_ENTRIES.items():
        path = run_dir / name
        if path.exists() and path.is_dir() != (kind == "directory"):
            found = "directory" if path.is_dir() else "file"
            raise ConfigError(f"--run-dir {run_dir}: {name} is a {found}, where the run keeps its {name} {kind}; "
                              "move it away, or choose another --run-dir")
    _refuse_mixed_runs(run_dir, resumed)


def _refuse_mixed_runs(run_dir: Path, resumed: Path | None) -> None:
    """A run directory holds one run: none yet, or the run of `resumed` (the checkpoint continued)
    with no checkpoint after it. A run continued from an earlier checkpoint among later ones would
    mix two histories, and checkpoint.keep, which keeps the highest steps, would delete its new
    checkpoints as it saved them."""
    if resumed is not None and _same_dir(resumed.parent.parent, run_dir):
        later = [path.name for step, path in complete_checkpoints(run_dir) if step > checkpoint_step(resumed)]
        if later:
            listed = ", ".join(later[:3]) + (f" and {len(later) - 3} more" if len(later) > 3 else "")
            raise ConfigError(f"--resume {resumed}: {run_dir} holds later checkpoints ({listed}) that "
                              "the continued run would be mixed with; continue it in a new --run-dir, or "
                              "delete those checkpoints")
        return
    if not run_dir_holds_run(run_dir):
        return
    if latest_checkpoint(run_dir) is None:  # stopped (or still running) before its first save
        raise ConfigError(f"--run-dir {run_dir} already holds a run that saved no checkpoint to resume; "
                          "choose another --run-dir, or delete that one")
    raise ConfigError(f"--run-dir {run_dir} already holds a run; continue it with "
                      f"--resume {run_dir} or choose another --run-dir")


_CONFIG_HYPERPARAMETERS = ("initial_lr", "betas", "eps", "weight_decay")
"""An optimizer group's values that come from [train]; its moments' dtypes stay the checkpoint's."""


@dataclasses.dataclass
class _Window:
    """What accumulates between two log steps; losses stay on the device until logged."""
    first_step: int
    start: float = dataclasses.field(default_factory=lambda: time.perf_counter())  # module's clock, at opening
    steps: int = 0
    loss_sums: dict = dataclasses.field(default_factory=dict)
    grad_norm_sum: torch.Tensor | float = 0.0

    def add(self, losses: dict[str, torch.Tensor], grad_norm: torch.Tensor) -> None:
        """One more step's losses and gradient norm, summed on the device (no host sync)."""
        self.steps += 1
        for name, value in losses.items():
            self.loss_sums[name] = self.loss_sums.get(name, 0.0) + value
        self.grad_norm_sum += grad_norm

    @contextlib.contextmanager
    def paused(self):
        """Validation and saving are not training: their time stays out of the window's tokens/s
        (as Megatron-Core and TorchTitan count it)."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - began


class Trainer:
    launch_command = TRAIN_LAUNCH
    """How the command that runs this trainer starts its ranks (named when a layout needs them)."""

    def __init__(self, cfg: Config, run_dir: Path, resume: Path | None = None,
                 out: Callable[[str], None] = print, init_from_hf: Path | None = None,
                 notes: Sequence[str] = ()):
        """`resume`: a run directory or checkpoint to continue (a weights-only checkpoint, as
        `moefold convert` writes, starts a fresh optimizer); `init_from_hf`: a Hugging Face
        checkpoint directory whose weights the model starts from (cfg.model/moe must match it);
        `notes`: lines said as the run starts (`read_run_config`'s on the options it dropped)."""
        validate(cfg)  # a Config changed in Python since load_config checked it
        self.cfg, self.run_dir, self.out, self._notes = cfg, Path(run_dir), out, list(notes)
        self.init_from_hf = init_from_hf
        refuse_unsupported_parallel(cfg)
        checkpoint = resolve_checkpoint(resume) if resume is not None else None
        refuse_run_dir(self.run_dir, checkpoint)
        saved, self._saved_config_source = (_saving_run_config(checkpoint) if checkpoint is not None
                                            else (None, ""))
        self.resumed_from = checkpoint
        full_state = checkpoint is not None and "optim" in checkpoint_keys(checkpoint)  # else weights only
        self._changed_model_options = _changed_model_options(cfg, saved) if saved is not None else []
        if saved is not None:
            _refuse_changed_ties(cfg, saved, checkpoint, full_state)
        if full_state and saved is not None:
            _refuse_changed_state_dtypes(cfg, saved, checkpoint)
        self.dist, self.device = join(cfg, cfg.train.device, self.launch_command)
        # Several ranks vote on a stop signal every step (train/stop.py); built on each at once.
        self._stop_vote = StopVote() if self.dist.layout is not None else None
        self._stop_signal: int | None = None  # this rank's, recorded by the handlers `fit` installs
        refuse_weight_cache_over_fsdp(cfg, self.dist.layout)
        if not self.dist.is_main:  # rank 0 speaks for the job
            self.out = lambda line: None
        self.grad_accum = micro_batches_per_step(cfg.train, self.dist.dp_size)
        torch.manual_seed(cfg.train.seed)
        self.compute_dtype = resolve_compute_dtype(cfg.precision.compute_dtype, self.device)
        self._build_data()
        self.step_batches = StepBatches(self.train_loader, self.grad_accum, self._data_vote_group())
        refuse_model_beyond_memory(cfg, self.vocab_size, self.dist.world,
                                   rank_capacity(self.device, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        self._build_model(_checkpoint_fill(checkpoint, full_state) if checkpoint is not None else None)
        self.optimizer = build_optimizer(self.data_parallel.optimized, cfg.train, self.device, cfg.optim)
        self.data_parallel.optimizer_built()
        self.clip_gradients = GradNormClipper(list(self.data_parallel.optimized.parameters()),
                                              dist.group.WORLD if self.dist.layout else None,
                                              clip_scaling(self.optimizer, cfg.optim))
        self.scheduler = build_scheduler(self.optimizer, cfg.train)
        self.step = 0
        # [(step, tokens per expert per layer)] of every log window, for the heatmap; checkpointed.
        self.load_history: list[tuple[int, list[list[int]]]] = []
        self._saved_global_batch: int | None = None  # the global batch of the run resumed (`_load`)
        if full_state:
            self._load(checkpoint)
        if self.step > cfg.train.steps:  # before config.toml is rewritten with the smaller count
            raise ConfigError(f"train.steps={cfg.train.steps}: the run is already at step {self.step}; "
                              "give more steps to continue it")
        refresh_weight_caches(self.model)  # precision.fp8_weight_cache: from the weights it starts with
        self.dist.barrier()  # every rank has checked the run dir before rank 0 writes into it
        self._run_lock = RunDirLock(self.run_dir)
        if self.dist.is_main and not self._nothing_to_train():  # a finished run: nothing written anywhere
            self._prepare_run_dir()

    # ----------------------------------------------------------------------------------- build

    def _build_data(self) -> None:
        cfg = self.cfg
        self.tokenizer = build_tokenizer(cfg.data.tokenizer)
        self.vocab_size = model_vocab_size(cfg, self.tokenizer)
        # A text corpus is encoded once over the ranks, each a share, over the stop vote's gloo group.
        host_group = self._stop_vote.group if self._stop_vote is not None else None
        streams = build_token_streams(cfg.data, self.tokenizer, vocab_size=self.vocab_size, group=host_group)
        self.data_source = streams.source
        t, dp, rank = cfg.train, self.dist.dp_size, self.dist.dp_rank
        # The loader walks the global micro-batch's order (micro_batch_size sequences per data rank),
        # so the data order does not depend on the layout, and reads only this data rank's rows.
        global_micro_batch = t.micro_batch_size * dp
        train_seqs = PackedSequences(streams.train_N, t.seq_len, name="training")
        self._data_fingerprint = stream_fingerprint(streams.train_N)  # what a resume checks it continues on
        self.train_loader = TrainLoader(train_seqs, global_micro_batch, t.seed, streams.eos_id,
                                        vocab=streams.vocab, step_size=global_micro_batch * self.grad_accum,
                                        data_rank=rank, data_ranks=dp)
        self.val_batches, self._val_rows_any_rank = [], []
        if streams.val_N.size:  # data.val_fraction = 0 turns validation off
            val_seqs = PackedSequences(streams.val_N, t.seq_len, name="validation")
            # The first val_batches · micro_batch_size sequences on any layout, shared by the data ranks.
            self.val_batches = read_agreed(lambda: val_batches(
                val_seqs, t.micro_batch_size, t.val_batches, streams.eos_id, vocab=streams.vocab,
                data_ranks=dp, data_rank=rank), self._data_vote_group())
            # Each batch's largest share (tensor_split's first), what every data rank pads to (`_val_rows`).
            self._val_rows_any_rank = [-(-rows // dp) for rows in
                                       val_batch_rows(len(val_seqs), t.micro_batch_size, t.val_batches, dp)]

    def _build_model(self, resumed_fill: Callable[[Transformer], None] | None) -> None:
        """`resumed_fill`: how a resumed run's weights start (`_checkpoint_fill`); None: from
        --init-from-hf or the seed."""
        cfg = self.cfg
        # Built on the meta device, allocated and filled where it trains once parallelized: no
        # host copy, no wasted constructor init, and each rank holds only its shards.
        if self.init_from_hf is not None:
            from moefold.checkpoint.hf import (  # needs safetensors (the hf extra)
                fill_pretrained,
                pretrained_on_meta,
            )

            model = pretrained_on_meta(self.init_from_hf, self.device.type, self.compute_dtype, cfg=cfg)
            if model.vocab_size < self.tokenizer.vocab_size:
                raise ConfigError(f"--init-from-hf {self.init_from_hf}: its vocabulary "
                                  f"({model.vocab_size}) is smaller than the tokenizer's "
                                  f"({self.tokenizer.vocab_size}); set data.tokenizer")
            fill = partial(fill_pretrained, path=self.init_from_hf)
        else:
            with torch.device("meta"):
                model = build_model(cfg, self.vocab_size, self.device.type, self.compute_dtype)
            fill = partial(Transformer.init_weights, seed=cfg.train.seed)
        if resumed_fill is not None:
            fill = resumed_fill
        initialize = partial(_materialize_and_fill, device=self.device, fill=fill)
        # FP8 GEMMs where precision.fp8 says. Parameters end up in the compute dtype unless fp32
        # masters train under bf16 autocast, where every linear casts its own copy of its input.
        autocast_over_fp32 = cfg.optim.master_dtype == "fp32" and self.compute_dtype != torch.float32
        converted = apply_fp8(model, cfg.precision, self.device.type, shared_inputs=not autocast_over_fp32,
                              compute_dtype=self.compute_dtype,
                              sequence_parallel=cfg.parallel.shards_sequence,
                              tp=cfg.parallel.tp, etp=cfg.parallel.etp)
        if cfg.precision.fp8 != "off" and not converted:
            self.out(f"warning: precision.fp8={cfg.precision.fp8} converts no module (precision.fp8_exclude "
                     "and fp8_bf16_first/last_layers keep every one in high precision): this run is not FP8")
        if cfg.precision.fp8 != "off" and self.device.type == "cuda":
            self.out("warning: precision.fp8 on CUDA trains like bf16 but runs at about its speed "
                     "(docs/fp8.md)" + ("; with several micro-batches a step, precision.fp8_weight_cache=true "
                                        "quantizes the experts' weights once a step"
                                        if self.grad_accum > 1 and not cfg.precision.fp8_weight_cache else ""))
        self.model: Transformer = model
        for layer in self.model.moe_layers():
            layer.aux_loss_scale = 1.0 / self.grad_accum  # the CE loss is averaged the same way
        self.head_loss = build_head_loss(cfg.train.loss_chunk_tokens, cfg.train.compile)  # validation's too
        self.objective = build_objective(self.model, self.head_loss)
        self.param_counts = count_params(self.model)  # of the whole model, before sharding
        self.flops_per_token = train_flops_per_token(self.model, cfg.train.seq_len)
        self.data_parallel = DataParallel(self.model)  # the optimizer updates the model itself
        if self.dist.layout is not None:
            grad_dtype = GRAD_DTYPES[cfg.optim.grad_dtype] if cfg.optim.grad_dtype != "fp32" else None
            self.data_parallel = parallelize(self.model, self.dist.layout, cfg.parallel, grad_dtype,
                                             initialize)
        else:
            initialize(self.model)
        if cfg.train.compile:
            compile_blocks(self.model)
        self.peak_tflops = peak_tflops(self.device, cfg.logging.peak_tflops)
        autocast_on = self.compute_dtype != torch.float32
        self.autocast = (partial(torch.autocast, self.device.type, dtype=self.compute_dtype)
                         if autocast_on else contextlib.nullcontext)

    def _prepare_run_dir(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._run_lock.acquire()  # held until fit() returns
        try:
            _refuse_mixed_runs(self.run_dir, self.resumed_from)  # again: a training may have started here since
            config = to_toml(_with_absolute_data_paths(self.cfg))  # on disk before the training it describes
            write_atomically(self.run_dir / "config.toml", lambda tmp: tmp.write_text(config))
        except BaseException:
            self._run_lock.release()
            raise

    # ----------------------------------------------------------------------------- checkpoints

    def _state(self) -> dict[str, Any]:
        # The optimizer's parameters may be ZeRO-1's shards: named as the model's, not the model's.
        model_sd = get_model_state_dict(self.model)
        optim_sd = get_optimizer_state_dict(self.data_parallel.optimized, self.optimizer)
        # No schedule: it is the config's at `step` (`_load`). Checkpoints that hold one load too.
        return {"model": model_sd, "optim": optim_sd, "data": self.step_batches.state_dict(),
                "data_order": self._data_order(), "step": self.step, "rng": rng_state(),
                "expert_load": self.load_history, "global_batch": self._global_batch(),
                "data_fingerprint": self._data_fingerprint,
                CONFIG_KEY: to_toml(_with_absolute_data_paths(self.cfg))}

    def _global_batch(self) -> int:
        """Sequences per optimizer step, over every data rank."""
        return self.cfg.train.micro_batch_size * self.dist.dp_size * self.grad_accum

    def _data_order(self) -> dict[str, int]:
        """What the loader's position (epoch, cursor) counts in: its sequences and their seeded order."""
        return {"sequences": len(self.train_loader.sequences), "seq_len": self.cfg.train.seq_len,
                "seed": self.cfg.train.seed}

    def _load(self, path: Path) -> None:
        """A full checkpoint's model, optimizer, data order, step and RNG; the schedule is rebuilt at
        the step."""
        state = self._state()
        del state[CONFIG_KEY]  # read by the resume checks (`_saving_run_config`)
        saved_keys = checkpoint_keys(path)
        for key in ("expert_load", "data_order", "global_batch", "data_fingerprint"):  # saved by later versions
            if key not in saved_keys:
                del state[key]
        load_checkpoint(state, path)
        self._saved_global_batch = int(state["global_batch"]) if "global_batch" in state else None
        if "data_order" in state:
            _refuse_other_data_order(state["data_order"], self._data_order(), path)
        if "data_fingerprint" in state:
            _refuse_other_data(state["data_fingerprint"], self._data_fingerprint, path)
        self.load_history = list(state.get("expert_load", []))  # the heatmap covers the whole run
        set_model_state_dict(self.model, state["model"])  # ZeRO-1's shards follow (a load hook)
        # The config's hyperparameters, not the saved ones torch's load puts back: a resume with
        # --train.lr, betas, eps or weight decay changed trains with them.
        config_values = [{key: group[key] for key in _CONFIG_HYPERPARAMETERS} for group in self.optimizer.param_groups]
        try:
            set_optimizer_state_dict(self.data_parallel.optimized, self.optimizer, state["optim"])
        except (RuntimeError, KeyError, ValueError) as e:  # same tensors, other parameters: a tied head
            reason = " ".join(str(e).split(". ")[0].split())
            raise CheckpointError(f"checkpoint {path}: its optimizer state does not fit this model ({reason}): "
                                  "a run continues with the model.* and moe.* it was trained with") from None
        for group, values in zip(self.optimizer.param_groups, config_values, strict=True):
            group.update(values)
        self.step = int(state["step"])
        self.scheduler = build_scheduler(self.optimizer, self.cfg.train, steps_done=self.step)
        self.step_batches.load_state_dict(state["data"])
        set_rng_state(state["rng"])

    def save(self) -> Path:
        return save_checkpoint(self._state(), self.run_dir, self.step, self.cfg.checkpoint.keep)

    def _save_after_records(self) -> Path:
        """The training loop's save: metrics.jsonl flushed to disk first, so that a power cut
        never keeps a checkpoint while losing the records of its steps (a run resumed from it
        logs only the steps after it)."""
        self.sinks.sync()
        return self.save()

    # ------------------------------------------------------------------------------- the step

    def _data_vote_group(self) -> dist.ProcessGroup | None:
        """The gloo group the ranks agree on a data error over (`step_data`): the stop vote's, where
        data ranks read different rows; None where every rank reads the same ones."""
        return self._stop_vote.group if self.dist.dp_size > 1 else None

    def _to_device(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """This data rank's batch (the loaders read only its rows) on the device. To CUDA through
        pinned memory: from pageable memory the driver stages the copy and "may synchronize with
        the stream" (CUDA's API sync behaviour), a wait for the kernels queued before it at every
        micro-batch; from pinned memory the copy is queued and the host goes on. The pinned rows
        may be dropped at once: torch's caching host allocator records the copy on the stream and
        reuses their block only after it."""
        rows = (batch.input_ids_BS, batch.labels_BS)
        if self.device.type == "cuda":  # pinning needs a CUDA context; a CPU copy is no copy
            rows = tuple(t.pin_memory() for t in rows)
        return tuple(t.to(self.device, non_blocking=True) for t in rows)

    def train_step(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """One optimizer step over grad_accum micro-batches; (mean loss parts, grad norm), both on
        the device. `lm_loss` is the next-token loss; other parts (mtp_loss) as the objective has.
        Loss parts are this data rank's; the log averages them over the data ranks."""
        parts = self.accumulate_gradients()
        return parts, self.optimizer_step()

    def accumulate_gradients(self) -> dict[str, torch.Tensor]:
        """Forward and backward of the step's micro-batches; afterwards every parameter holds the
        gradient of the global batch's mean loss (data-parallel reduction included)."""
        accum = self.grad_accum
        parts_sum: dict[str, torch.Tensor] = {}
        for batch in self.step_batches.next_step():
            input_ids_BS, labels_BS = self._to_device(batch)
            with self.autocast():
                total, parts = self.objective(self.model, input_ids_BS, labels_BS)
            (total / accum).backward()
            for name, value in parts.items():
                parts_sum[name] = parts_sum.get(name, 0.0) + value
        if self._another_step_follows():  # the next step's rows, read while this one's kernels run
            self.step_batches.read_ahead()
        self.data_parallel.reduce_gradients()  # left after backward (ZeRO-1; FSDP: nothing)
        return {name: value / accum for name, value in parts_sum.items()}

    def _another_step_follows(self) -> bool:
        """Whether the run trains a step after the one running (`step` counts those done before
        it): the last one reads nothing ahead, which no step would train on, nor one a signal
        stops the run after (`_stop_known`)."""
        return self.step + 1 < self.cfg.train.steps and not self._stop_known()

    def _stop_known(self) -> bool:
        """Whether the run stops on a signal after the step running, known before it ends. One
        process: its own signal, if it came before now (it stops after the step it arrived in).
        Several ranks: the vote started at the boundary before, which its end reads
        (`StopVote.settled`): waited for earlier in the step, not once more, and the same on
        every rank, so all read ahead or none (a read-ahead's data vote is a collective)."""
        if self._stop_vote is None:
            return self._stop_signal is not None
        return self._stop_vote.settled() is not None

    def optimizer_step(self) -> torch.Tensor:
        """Clip (one norm across both meshes), step, update expert biases; returns the grad norm."""
        grad_norm = self.clip_gradients(self.cfg.train.grad_clip or float("inf"))
        self.optimizer.step()
        self.data_parallel.gather_parameters()  # ZeRO-1: the updated shards into the full parameters
        refresh_weight_caches(self.model)  # precision.fp8_weight_cache: quantized once per step
        self.model.on_optimizer_step()  # expert-bias update, global aux-loss counts reset
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _val_rows(self, batch: Batch, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This data rank's rows of validation batch `index` on the device, padded to as many as any
        data rank holds (`_val_rows_any_rank`, from the global batch's size): a small validation
        set's one batch may not split evenly over dp (7 sequences: 4 and 3), and the static-shape
        EP dispatchers (capacity all-to-all, all-gather) need the same tokens on every rank of a
        group; then to tokens the TP ranks split for the routed
        experts without sequence parallelism (3 rows of 15 over tp 2: 4 rows). Padding rows have
        no labels and reach no expert (valid_BS False). (input ids, labels, valid_BS or None where
        nothing is padded)."""
        input_ids_BS, labels_BS = self._to_device(batch)
        rows, seq_len = self._val_rows_any_rank[index], input_ids_BS.shape[1]
        rows_tp_divides = self.cfg.parallel.tp // math.gcd(seq_len, self.cfg.parallel.tp)
        rows = -(-rows // rows_tp_divides) * rows_tp_divides
        missing = rows - input_ids_BS.shape[0]
        if missing == 0:
            return input_ids_BS, labels_BS, None
        valid_BS = (torch.arange(rows, device=self.device) < input_ids_BS.shape[0])[:, None].expand(rows, seq_len)
        return (F.pad(input_ids_BS, (0, 0, 0, missing)), F.pad(labels_BS, (0, 0, 0, missing), value=IGNORE_INDEX),
                valid_BS)

    @torch.no_grad()
    def validate(self) -> float:
        """Token-weighted mean loss over the fixed validation batches (in eval mode, so MoE layers
        record no statistics and no aux losses). nan when no validation token has a label (every
        one IGNORE_INDEX): a mean over no tokens, as `F.cross_entropy` gives one; the run starts with a
        warning saying so (`_announce`), and trains on."""
        self.model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss · tokens, tokens
        for index, batch in enumerate(self.val_batches):
            input_ids_BS, labels_BS, valid_BS = self._val_rows(batch, index)
            with self.autocast():  # the head through the training's loss: in chunks under loss_chunk_tokens
                h_BSD, _ = self.model.trunk(input_ids_BS, valid_BS)
                loss = self.head_loss(self.model.output, self.model.norm(h_BSD), labels_BS)
            targets = (labels_BS != IGNORE_INDEX).sum()  # what the mean loss divides by
            # No targets: the mean is nan, and nan · 0 would poison the sum.
            loss = loss_or_zero(loss, labels_BS)
            sums[0] += loss.double() * targets
            sums[1] += targets
        self.model.train()
        total, tokens = self.dist.sum_over_data(sums).tolist()  # HOST SYNC: once per validation
        return total / tokens if tokens else math.nan

    # ------------------------------------------------------------------------------- the loop

    def fit(self) -> dict[str, Any]:
        """Train to cfg.train.steps; returns the last train and validation metrics."""
        try:
            return self._fit()
        finally:
            self._run_lock.release()  # the run directory is free for the next training (a resume)

    def _nothing_to_train(self) -> bool:
        """A resumed run already at train.steps."""
        return self.resumed_from is not None and self.step == self.cfg.train.steps

    def _fit(self) -> dict[str, Any]:
        self._announce()
        if self._nothing_to_train():  # nothing to run, nothing re-saved
            self.out(f"nothing to train: the run is already at step {self.step} = train.steps; "
                     f"give --train.steps above {self.step} to continue it")
            return {}
        with self._loop_outputs() as (bar, emit):
            return self._train_loop(bar, emit)

    @contextlib.contextmanager
    def _loop_outputs(self):
        """What lives as long as the loop: the metric sinks, the stop-signal handlers and the
        progress bar; yields the bar and where lines go (above the bar while it shows)."""
        log = self.cfg.logging
        self.sinks = (metrics.MetricsSinks(self.run_dir, log.tensorboard, self.out, first_step=self.step + 1)
                      if self.dist.is_main else metrics.NullSinks())
        self._stop_signal = None
        previous_handlers = self._install_signal_handlers()
        show_bar = log.progress_bar and metrics.is_interactive() and self.dist.is_main
        bar = tqdm(total=self.cfg.train.steps, initial=self.step, disable=not show_bar,
                   dynamic_ncols=True, leave=False)
        try:
            yield bar, (tqdm.write if not bar.disable else self.out)
        finally:
            bar.close()
            self.sinks.close()
            self._restore_signal_handlers(previous_handlers)

    def _train_loop(self, bar: tqdm, emit: Callable[[str], None]) -> dict[str, Any]:
        """Steps to train.steps, each followed by what is due at its end, in this order: a log
        line (at log steps and checkpoint steps), a validation, a checkpoint, a stop on a signal;
        then the final checkpoint. Returns the last train and validation records (and that
        checkpoint's path)."""
        last: dict[str, Any] = {}
        window = _Window(first_step=self.step + 1)
        while self.step < self.cfg.train.steps:
            lr = self.optimizer.param_groups[0]["lr"]  # the rate this step trains with
            window.add(*self.train_step())
            self.step += 1
            bar.update(1)
            if self._window_ends():
                last.update(self._close_window(window, lr, emit))
                window = _Window(first_step=self.step + 1)
            if self._validation_due():
                with window.paused():
                    last.update(self._log_validation(emit))
            saved = self._save_if_due(window)
            signum = self._stop_requested(synced=saved is not None)
            if signum is not None:
                self._stop(signum, window, lr, saved, emit)
        if self.cfg.checkpoint.save_at_end and self.cfg.train.steps > 0:  # the last step's window is closed
            last["checkpoint"] = str(self._save_after_records())
        self._write_end_of_run()
        return last

    def _close_window(self, window: _Window, lr: float, emit) -> dict[str, Any]:
        """The window's log record, written; then a stop if its steps diverged (the log has
        just read their gradient norm)."""
        record = self._log_window(window, lr, emit)
        self._refuse_diverged(window)
        return record

    def _save_if_due(self, window: _Window) -> Path | None:
        """The checkpoint of this step when one is due, else None. Never of diverged weights: the
        window that ended at this step has refused them (`_window_ends`)."""
        if not self._checkpoint_due():
            return None
        with window.paused():
            return self._save_after_records()

    def _stop(self, signum: int, window: _Window, lr: float, saved: Path | None, emit) -> NoReturn:
        """Ends the run on a signal at this step boundary: the steps since the last log step go
        on record, then the checkpoint to resume from. A signal during a due save stops with
        that checkpoint (`saved`), not a second copy."""
        if window.steps:
            self._close_window(window, lr, emit)
        checkpoint = saved or self._save_after_records()
        if self.step == self.cfg.train.steps:  # the run is complete all the same
            self._write_end_of_run()
        raise TrainingInterrupted(signum, self.step, checkpoint)

    def _refuse_diverged(self, window: _Window) -> None:
        """Stop before non-finite weights reach a checkpoint (where rotation would delete the good
        ones): a non-finite gradient norm poisons every weight it scales. The norm is global, so
        every rank stops at the same step. Read where the window's record reads it anyway (log and
        checkpoint steps, a signal's stop), never per step."""
        if not window.steps:
            return
        norm = float(window.grad_norm_sum)  # read already by the window's log record
        if math.isfinite(norm):
            return
        steps = f"step {self.step}" if window.first_step == self.step else f"steps {window.first_step}–{self.step}"
        raise TrainingDiverged(
            f"training diverged: the gradient norm was {norm} within {steps}, which leaves the weights "
            f"non-finite; nothing from these steps is saved. Lower train.lr (now {self.cfg.train.lr:g}) or "
            "raise train.warmup_steps, then resume from the last checkpoint")

    def _stop_requested(self, synced: bool) -> int | None:
        """The signal to stop on at this step boundary, or None. One process: its own, after the
        step it arrived in. Several ranks: the one any rank had, voted on every step off the
        training stream (`StopVote`), so every rank stops at the same step, after the one the
        signal arrived in or the next; read at once where the ranks have just waited for each
        other (`synced`: a save) and at the last step."""
        if self._stop_vote is None:
            return self._stop_signal
        agreed = self._stop_vote.agreed(self._stop_signal, now=synced or self.step == self.cfg.train.steps)
        if agreed is not None:
            self._stop_signal = agreed  # stopping: a signal from now on needs no acknowledgement
        return agreed

    def _log_due(self) -> bool:
        return self.step % self.cfg.logging.log_every == 0 or self.step == self.cfg.train.steps

    def _window_ends(self) -> bool:
        """A log step, or a checkpoint's: a run resumed from a checkpoint opens its first window
        after it, so the one that ends there is logged before the save. Else the window's steps
        up to the checkpoint were in no record after a crash past it, and the resumed run's next
        record covered fewer steps than the uninterrupted run's."""
        return self._log_due() or self._checkpoint_due()

    def _validation_due(self) -> bool:
        every, steps = self.cfg.train.val_every, self.cfg.train.steps
        return bool(self.val_batches) and ((every and self.step % every == 0) or self.step == steps)

    def _write_end_of_run(self) -> None:
        """What a run writes once its last step is trained (a signal in that step included): the
        expert-load heatmap of the whole run."""
        if not (self.cfg.logging.expert_load_heatmap and self.load_history and self.dist.is_main):
            return
        path = write_load_heatmap(self.load_history, self.run_dir / "expert_load.png",
                                  self.model.moe_layer_ids())
        self.out(f"expert load heatmap: {path}" if path else
                 "expert load heatmap skipped: needs matplotlib (pip install 'moefold[viz]')")

    def _checkpoint_due(self) -> bool:
        """A step of checkpoint.every's; the last one too unless save_at_end saves it after the loop."""
        every, last = self.cfg.checkpoint.every, self.step == self.cfg.train.steps
        return bool(every) and self.step % every == 0 and not (last and self.cfg.checkpoint.save_at_end)

    def _log_window(self, window: _Window, lr: float, emit) -> dict[str, Any]:
        names = list(window.loss_sums)
        sums = self.dist.mean_over_data(torch.stack([torch.as_tensor(window.loss_sums[n]).float()
                                                     for n in names]))
        losses = dict(zip(names, (v / window.steps for v in sums.tolist())))  # HOST SYNC: per log step
        loss = losses.pop("lm_loss")
        window.grad_norm_sum = float(window.grad_norm_sum)  # read once: _refuse_diverged reuses it
        grad_norm = window.grad_norm_sum / window.steps
        seconds = time.perf_counter() - window.start
        t, world = self.cfg.train, self.dist.world
        tokens = window.steps * self.grad_accum * t.micro_batch_size * self.dist.dp_size * t.seq_len
        per_device = metrics.throughput(tokens / world, seconds, self.flops_per_token, self.peak_tflops)
        record = {"step": self.step, "loss": loss, **losses, "grad_norm": grad_norm, "lr": lr,
                  **per_device, "tokens_per_s": per_device["tokens_per_s"] * world,
                  "peak_mem_gib": metrics.peak_memory_gib(self.device)}
        moe = summarize([self._over_data_ranks(layer.stats.pop()) for layer in self.model.moe_layers()])
        counts = moe.pop("tokens_per_expert_per_layer", None)  # L×E: for the heatmap, not the log
        if counts is not None:
            append_window(self.load_history, self.step, counts)
        record.update(moe)
        self._add_memory_prediction(record, emit)
        self.sinks.write(record)
        emit(metrics.format_line(record, self.cfg.train.steps))
        return record

    def _add_memory_prediction(self, record: dict[str, Any], emit) -> None:
        """Once, on a GPU: the planner's per-GPU peak beside the measured one (docs/memory.md)."""
        if self.device.type != "cuda" or getattr(self, "_memory_predicted", False):
            return
        self._memory_predicted = True
        try:
            from moefold.plan import predict_memory

            predicted = predict_memory(self.cfg, self.dist.world, vocab_size=self.vocab_size).peak / 2**30
        except Exception as e:  # a planning gap must never stop training
            emit(f"memory: planner could not predict this run ({type(e).__name__}: {e})")
            return
        record["memory_predicted_gib"] = predicted
        emit(f"memory: peak {record['peak_mem_gib']:.2f} GiB measured, {predicted:.2f} GiB predicted "
             f"by the planner (moefold plan memory)")

    def _over_data_ranks(self, raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A layer's popped statistics for the global batch: token counts already are (summed
        over the data ranks as they are recorded); entropy sums add up; aux-loss sums average,
        each data rank's loss being its share of the global one."""
        for key, value in raw.items():
            if key in (ENTROPY_SUM, ENTROPY_TOKENS):
                raw[key] = self.dist.sum_over_data(value)
            elif key.startswith(AUX_SUM):
                raw[key] = self.dist.mean_over_data(value)
        return raw

    def _log_validation(self, emit) -> dict[str, Any]:
        record = {"step": self.step, "val_loss": self.validate()}
        self.sinks.write(record)
        emit(metrics.format_line(record, self.cfg.train.steps))
        return record

    def _announce(self) -> None:
        p = self.param_counts
        resumed = self.resumed_from
        lines = [f"run dir: {self.run_dir}" + (f" (resumed from {resumed})" if resumed else ""),
                 f"device: {self.device} ({self.compute_dtype})",
                 f"data: {self.data_source}",
                 f"model: {params_line(p.main_total, p.main_active, p.mtp, p.mtp_active)}; "
                 f"{self.flops_per_token / 1e6:.2f} MFLOP per token (fwd+bwd)"]
        if self.dist.layout is not None:
            d, par = self.dist.layout.dims, self.cfg.parallel
            lines.append(f"parallel: {d.world} ranks ({dist.get_backend()}), attention (pp, dp, cp, "
                         f"tp) = ({d.pp}, {d.dp}, {d.cp}, {d.tp}), experts (pp, edp, ep, etp) = "
                         f"({d.pp}, {d.edp}, {d.ep}, {d.etp}), {par.data_parallel}, "
                         f"{par.ep_dispatcher if d.ep * d.etp > 1 else 'local'} dispatch")
        lines += self._notes + self._no_effect_here() + self._global_batch_note()
        if self._changed_model_options:
            lines.append(f"note: this run changes the model it resumes (compared with "
                         f"{self._saved_config_source}): {', '.join(self._changed_model_options)}")
        if self.val_batches and not self._any_validation_label():
            lines.append(f"warning: no validation token has a label (every label is {IGNORE_INDEX}): val_loss is nan "
                         "(null in metrics.jsonl)")
        for line in lines:
            self.out(line)

    def _any_validation_label(self) -> bool:
        """Whether any data rank's validation rows hold a label: each holds only its own (a
        collective: every rank announces)."""
        labelled = sum(int((b.labels_BS != IGNORE_INDEX).sum()) for b in self.val_batches)
        labelled_over_ranks = self.dist.sum_over_data(torch.tensor([labelled], device=self.device))
        return bool(labelled_over_ranks.item())  # HOST SYNC: once, as the run starts

    def _no_effect_here(self) -> list[str]:
        """Options without effect on this device or launch, said and not refused: one config file
        serves several launches (the ranks' sizes come with each), and CPU dry runs offload."""
        cfg, notes = self.cfg, []
        if cfg.memory.offload and self.device.type == "cpu":
            notes.append(f"note: memory.offload={cfg.memory.offload} has no effect on the CPU (its activations are "
                         "in host memory already)")
        p = cfg.parallel
        if p.ep * p.etp == 1 and p.ep_dispatcher != ParallelConfig.ep_dispatcher:
            notes.append(f"note: parallel.ep_dispatcher={p.ep_dispatcher!r} has no effect at parallel.ep·etp = 1 "
                         "(every expert is this rank's)")
        return notes

    def _global_batch_note(self) -> list[str]:
        """A resume keeps train.micro_batch_size per data rank: on other data ranks (or with other
        batch options) it trains another global batch than the run it continues, which is allowed,
        and said."""
        saved, given = self._saved_global_batch, self._global_batch()
        if saved is None or saved == given:
            return []
        t, seq_len = self.cfg.train, self.cfg.train.seq_len
        return [f"note: the checkpoint's run trained {saved} sequences ({saved * seq_len} tokens) per optimizer step, "
                f"this run trains {given} ({given * seq_len} tokens): train.micro_batch_size · data-parallel ranks "
                f"· grad_accum = {t.micro_batch_size} · {self.dist.dp_size} · {self.grad_accum}; "
                f"train.global_batch_size={saved} keeps the saved one"]

    # ---------------------------------------------------------------------------- signals

    def _install_signal_handlers(self) -> dict[int, Any]:
        def request_stop(signum, _frame):
            if self._stop_signal is None and self.dist.is_main:
                when = "after this step" if self._stop_vote is None else "after the next step at the latest"
                # os.write, not print: a handler printing while the loop prints is a reentrant call.
                os.write(2, f"moefold: {signal.Signals(signum).name} received; stopping {when} with "
                            "a checkpoint (SIGKILL stops at once, losing the steps since the last "
                            "one)\n".encode())
            self._stop_signal = signum  # acted on after the current step, with a checkpoint
        previous = {}
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                previous[signum] = signal.signal(signum, request_stop)
            except ValueError:  # not the main thread: leave signals to the caller
                pass
        return previous

    @staticmethod
    def _restore_signal_handlers(previous: dict[int, Any]) -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
