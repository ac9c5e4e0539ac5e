"""The `moefold` command line: train | generate | config.

Every config field is an option `--<section>.<field> VALUE` whose help is the field's docstring.
User errors print one line and exit with status 2; an output the storage failed to write (EIO), one
line and status 1; an interrupted run exits with 128 + signal.
"""

import argparse
import dataclasses
import difflib
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from moefold import __version__
from moefold.config import (SECTIONS, Config, apply_overrides, config_from_toml, field_docs, field_types,
                            load_config, preset_names, read_run_config, refuse_unsupported_parallel, to_toml,
                            validate)
from moefold.errors import (FULL_OR_READ_ONLY, ConfigError, OutputError, UserError, refuse_unwritable_dir,
                            report)

EXIT_FAILURE, EXIT_USAGE = 1, 2


def path_argument(text: str) -> Path:
    """A path option's value. An empty one (`--run-dir "$UNSET"`) is refused: Path('') is the
    current directory, where a run or a checkpoint was then written without a word."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path; give a directory or file")
    return Path(text)


def _name_or_path(text: str) -> str:
    if not text:  # load_config(None or '') takes the default preset
        raise argparse.ArgumentTypeError(f"an empty name; give a preset ({', '.join(preset_names())}) or a TOML file")
    return text


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="NAME|PATH", type=_name_or_path,
                        help=f"preset name ({', '.join(preset_names())}) or TOML file; default tiny")
    defaults = Config()
    docs = field_docs()
    for section in SECTIONS:
        group = parser.add_argument_group(f"[{section}]")
        for f in dataclasses.fields(getattr(defaults, section)):
            key = f"{section}.{f.name}"
            is_bool = field_types()[key] is bool
            default = getattr(getattr(defaults, section), f.name)
            group.add_argument(f"--{key}", dest=key, default=argparse.SUPPRESS, metavar="VALUE",
                               nargs="?" if is_bool else None, const="true" if is_bool else None,
                               help=f"{docs.get(key, '')} (default: {default!r})")


class _Parser(argparse.ArgumentParser):
    """argparse that says a usage error in one line (argparse prints the whole usage first: a
    hundred lines for `train`, whose every config field is an option); subcommands inherit it."""

    def error(self, message: str):
        report(f"moefold: error: {message} (see {self.prog} --help)")
        self.exit(EXIT_USAGE)


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="moefold", allow_abbrev=False, description="Train Mixture-of-Experts language models.")
    parser.add_argument("--version", action="version", version=f"moefold {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", allow_abbrev=False, help="train a model",
                                description="Train a model (default: the tiny preset on the embedded "
                                            "corpus). Any config field can be overridden.")
    train.add_argument("--run-dir", type=path_argument, help="where the run writes (default: runs/<timestamp>)")
    train.add_argument("--resume", type=path_argument, metavar="DIR",
                       help="continue the run in DIR: a run directory (its latest checkpoint, with its "
                            "config.toml; its checkpoints folder too) or one of its checkpoints (with the "
                            "config it was saved with; data.path and data.tokenizer from config.toml)")
    train.add_argument("--init-from-hf", type=path_argument, metavar="DIR",
                       help="start from a Hugging Face checkpoint directory (its config.json sets "
                            "[model] and the architecture of [moe], which options may change where "
                            "no weight's shape changes; aux losses, capacity and other training "
                            "settings of [moe] come from --config, or without one the aux loss "
                            "config.json states; its tokenizer.json is used when data.tokenizer "
                            "is unset)")
    train.add_argument("--nproc", type=int, default=1, metavar="N",
                       help="start N ranks on this machine (like torchrun --standalone "
                            "--nproc-per-node N): one per GPU, or N CPU processes with gloo")
    _add_config_options(train)

    gen = commands.add_parser("generate", allow_abbrev=False,
                              help="sample from a run's checkpoint (its latest, or one named)")
    gen.add_argument("--run-dir", type=path_argument, required=True, metavar="DIR",
                     help="what to sample from, as --resume takes it: a run directory (its latest checkpoint; "
                          "its checkpoints folder too) or one of its checkpoints, RUN/checkpoints/step_N (with "
                          "the config it was saved with; data.path and data.tokenizer from config.toml)")
    gen.add_argument("--prompt", required=True, help="text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=200,
                     help="tokens to sample (default 200); past the model's context (model.max_position_embeddings, "
                          "else YaRN's model.rope_original_max_len × model.rope_factor, else train.seq_len) "
                          "its window slides; a longer --prompt is refused")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default 0.8)")
    gen.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest; 0 = all (default 40)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    gen.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                     help="where the model runs; auto: the GPU when there is one (default auto)")

    convert = commands.add_parser("convert", allow_abbrev=False,
                                  help="convert between Hugging Face checkpoints and moefold runs")
    direction = convert.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", type=path_argument, metavar="DIR", help="a Hugging Face model directory")
    direction.add_argument("--run-dir", type=path_argument, metavar="DIR",
                           help="what to export, as --resume takes it: a moefold run (its latest checkpoint; its "
                                "checkpoints folder too) or one of its checkpoints, RUN/checkpoints/step_N (with the "
                                "config it was saved with)")
    convert.add_argument("--out", type=path_argument, metavar="RUN_DIR", help="with --from-hf: the run to create")
    convert.add_argument("--to-hf", type=path_argument, metavar="DIR", help="with --run-dir: the directory to write")
    convert.add_argument("--dtype", choices=tuple(_EXPORT_DTYPES), default=None,
                         help="with --to-hf: the weights' dtype (config.json's dtype and torch_dtype); DeepSeek-V3's "
                              "router weight and expert bias stay fp32, as transformers keeps them "
                              "(default: the run's master weights', lossless: fp32, or bf16 for "
                              "optim.master_dtype=bf16)")

    config = commands.add_parser("config", help="inspect configs")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    show = config_commands.add_parser("show", allow_abbrev=False, help="print the resolved config as TOML")
    _add_config_options(show)
    show.add_argument("--world-size", type=int, default=None, metavar="N",
                      help="print the parallel rank grid for N ranks (default: the smallest world "
                           "the layout fits)")
    config_commands.add_parser("presets", help="list the shipped presets")
    params = config_commands.add_parser("params", allow_abbrev=False,
                                        help="count the model's parameters (one block of each kind built on "
                                             "the meta device)")
    _add_config_options(params)
    _name_commands(config_commands)
    _add_plan_parser(commands)
    _add_bench_parser(commands)
    _name_commands(commands)
    return parser


def _name_commands(commands) -> None:
    """The commands' choices as their name ("{show,presets,params}", as the help shows them), so a
    missing one is named by them, not by its internal `dest`."""
    commands.metavar = "{" + ",".join(commands.choices) + "}"


def _add_bench_parser(commands) -> None:
    from moefold.bench.cli import add_arguments  # torch-free at import

    bench = commands.add_parser(
        "bench", allow_abbrev=False, help="time training steps on random tokens",
        description="Time N training steps (after W warm-up steps) of any config on random tokens: "
                    "step time, tokens/s per device (training's metrics.jsonl logs the whole job's), "
                    "TFLOP/s, MFU against the measured bf16 matmul peak, peak memory (docs/benchmarks.md).")
    add_arguments(bench)
    _add_config_options(bench)


def _add_plan_parser(commands) -> None:
    from moefold.plan.devices import DEVICES_GB  # torch-free at import

    plan = commands.add_parser("plan", help="predict resources of a training job")
    plan_commands = plan.add_subparsers(dest="plan_command", required=True)
    memory = plan_commands.add_parser(
        "memory", allow_abbrev=False, help="predict per-GPU memory (analytic, allocates nothing)",
        description="Predict the memory of the busiest GPU of a training job from the config and "
                    "the parallel layout (--parallel.*), without allocating it (docs/memory.md).")
    memory.add_argument("--gpus", type=int, default=None, metavar="N",
                        help="GPUs of the job (default: the fewest the layout fits)")
    memory.add_argument("--device", choices=sorted(DEVICES_GB), default="h200",
                        help="GPU to check the fit against: "
                             + ", ".join(f"{k} {v} GB" for k, v in DEVICES_GB.items())
                             + " (default h200)")
    memory.add_argument("--gpu-memory", type=float, default=None, metavar="GB",
                        help="memory per GPU in GB (10^9 bytes); overrides --device")
    memory.add_argument("--moe-imbalance", type=float, default=1.0, metavar="F",
                        help="rows of the busiest expert rank over the balanced share (default 1)")
    _add_config_options(memory)
    _name_commands(plan_commands)


def _reject_unknown(unknown: list[str]) -> None:
    for arg in unknown:
        if arg.startswith("--"):
            key = arg[2:].split("=", 1)[0]
            close = difflib.get_close_matches(key, list(field_types()), n=1, cutoff=0.6)
            hint = f"; did you mean --{close[0]}?" if close else ""
            raise ConfigError(f"unknown option --{key}{hint}")
    raise ConfigError(f"unexpected argument {unknown[0]!r}")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k in field_types()}


def _train(args: argparse.Namespace) -> int:
    from moefold.train.trainer import Trainer, TrainingInterrupted  # torch import only when needed

    overrides, notes = _overrides(args), []
    if args.resume is not None:
        # Where it is, not as written: `--resume step_00000002` from checkpoints/ names a checkpoint
        # of the run above (`_is_checkpoint_dir` reads the parents), `--resume .` inside it one too.
        args.resume = Path(os.path.abspath(args.resume))
        if args.config or args.init_from_hf:
            raise ConfigError("--config and --init-from-hf cannot be combined with --resume: the "
                              "run's config is used (config.toml, or the checkpoint's own); override "
                              "single fields instead")
        run_dir = args.run_dir or _run_dir_of(args.resume)
        cfg, notes, source = _resume_config(args.resume, overrides)
        _refuse_saved_layout_beyond_the_ranks(args.resume, cfg, overrides, source, args.nproc)
    elif args.init_from_hf is not None:
        cfg = _config_for_hf_model(args.init_from_hf, args.config, overrides)
        run_dir = args.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    else:
        cfg = load_config(args.config, overrides)
        run_dir = args.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    if args.nproc != 1:
        return _spawn_ranks(args, cfg, run_dir)
    try:
        trainer = Trainer(cfg, run_dir, resume=args.resume, init_from_hf=args.init_from_hf, notes=notes)
        trainer.fit()
        trainer.dist.barrier()  # every rank done before any tears the process group down
    except TrainingInterrupted as e:
        report(f"moefold: {e}")
        return 128 + e.signum
    finally:
        from moefold.parallel.launch import leave

        leave()
    return 0


def _spawn_ranks(args: argparse.Namespace, cfg: Config, run_dir: Path) -> int:
    """`--nproc N`: check what can be checked once, then run the same command as N ranks."""
    from moefold.checkpoint.dcp import resolve_checkpoint
    from moefold.parallel.dims import ParallelDims
    from moefold.parallel.launch import refuse_more_ranks_than_the_host_holds, resolve_device, spawn_local
    from moefold.plan.fit import rank_capacity, refuse_model_beyond_memory
    from moefold.train.trainer import refuse_run_dir

    if args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc} must be >= 1")
    if "WORLD_SIZE" in os.environ:
        raise ConfigError("--nproc cannot be used under torchrun (it already started the ranks)")
    refuse_unsupported_parallel(cfg)  # before the world size: no count of ranks would run these
    p = cfg.parallel
    ParallelDims(args.nproc, p.tp, p.cp, p.pp, p.ep, p.etp, p.order)  # the layout fits N ranks
    refuse_run_dir(run_dir, resolve_checkpoint(args.resume) if args.resume is not None else None)
    device = resolve_device(cfg.train.device)  # the tokenizer's vocabulary is not counted here
    refuse_more_ranks_than_the_host_holds(args.nproc, device)
    refuse_model_beyond_memory(cfg, cfg.model.vocab_size, args.nproc, rank_capacity(device, args.nproc))
    return spawn_local(args.nproc, [*_without_nproc(args.argv), "--run-dir", str(run_dir)])


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def _config_for_hf_model(hf_dir: Path, preset: str | None, overrides: dict[str, Any]) -> Config:
    """[model] and the architecture of [moe] from the checkpoint's config.json; everything else
    (the [moe] fields of how it trains: aux losses, capacity, ...) from the preset — without one,
    the load-balancing loss config.json states, as `convert --from-hf` keeps it —; then the
    overrides. The checkpoint's tokenizer.json is the default tokenizer."""
    from moefold.checkpoint.hf import checkpoint_config
    from moefold.checkpoint.hf_families import HF_LOSS_FIELDS, TRAINING_MOE_FIELDS

    hf_cfg = checkpoint_config(hf_dir)  # convert --from-hf's reader: its refusals name the file
    tokenizer = Path(hf_dir) / "tokenizer.json"
    defaults = {"data.tokenizer": str(tokenizer)} if tokenizer.is_file() else {}
    cfg = load_config(preset, {**defaults, **{k: v for k, v in overrides.items()
                                              if not k.startswith(("model.", "moe."))}})
    from_preset = [name for name in TRAINING_MOE_FIELDS if preset or name not in HF_LOSS_FIELDS]
    training = {name: getattr(cfg.moe, name) for name in from_preset}
    cfg = dataclasses.replace(cfg, model=hf_cfg.model, moe=dataclasses.replace(hf_cfg.moe, **training))
    apply_overrides(cfg, {k: v for k, v in overrides.items() if k.startswith(("model.", "moe."))})
    validate(cfg)
    if "model.mtp_layers" in overrides:  # config.json's value is dropped without the tensors; the user's is not
        from moefold.checkpoint.hf import refuse_absent_mtp

        refuse_absent_mtp(hf_dir, cfg)
    return cfg


_EXPORT_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""convert --dtype: its values (named as the config's dtypes are) and torch's names."""


def _convert(args: argparse.Namespace) -> int:
    import torch

    from moefold.checkpoint.hf import CONFIG, check_exportable, save_pretrained
    from moefold.data.tokenizer import tokenizer_files
    from moefold.generate import checkpoint_run_config, learned_end_of_document_id, load_model_from_run

    if args.from_hf is not None:
        if args.out is None or args.to_hf is not None:
            raise UserError("convert --from-hf DIR needs --out RUN_DIR (and no --to-hf)")
        if args.dtype is not None:
            raise UserError(f"convert --dtype {args.dtype} sets the weights of a --to-hf export; a run "
                            "made by --from-hf holds fp32 weights (its optimizer's masters)")
        return _convert_from_hf(args.from_hf, args.out)
    if args.to_hf is None or args.out is not None:
        raise UserError("convert --run-dir RUN_DIR needs --to-hf DIR (and no --out)")
    refuse_unwritable_dir(args.to_hf, "--to-hf")
    if (args.to_hf / CONFIG).exists():
        raise UserError(f"--to-hf {args.to_hf} already holds a checkpoint ({CONFIG}); choose another directory")
    run_dir, checkpoint = _run_and_checkpoint(args.run_dir)
    cfg, notes = checkpoint_run_config(run_dir, checkpoint, "convert exports")  # the model the checkpoint holds
    _say_notes(notes)
    check_exportable(cfg)  # a family without export: before the weights are read
    # By default the weights as the optimizer holds them: bf16+remainder's exact fp32 masters; bf16
    # masters are bf16 (written as such, not widened).
    model, tokenizer, cfg = load_model_from_run(run_dir, "cpu", exact_masters=True, checkpoint=checkpoint, cfg=cfg)
    default = "bf16" if cfg.optim.master_dtype == "bf16" else "fp32"
    dtype = getattr(torch, _EXPORT_DTYPES[args.dtype or default])
    save_pretrained(model, args.to_hf, dtype=dtype, copies=tokenizer_files(cfg.data.tokenizer),
                    eos_token_id=learned_end_of_document_id(cfg, tokenizer, model.vocab_size, checkpoint))
    print(f"converted {checkpoint} -> {args.to_hf}")  # the checkpoint read, not the path given
    return 0


def _convert_from_hf(hf_dir: Path, out: Path) -> int:
    """Under the run directory's lock, as a training takes it: neither writes over the other."""
    from moefold.train.run_lock import CONVERSION, RunDirLock
    from moefold.train.trainer import run_dir_holds_run

    refuse_unwritable_dir(out, "--out")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    lock = RunDirLock(out, "--out", CONVERSION)
    lock.acquire()
    try:
        if run_dir_holds_run(out):
            raise UserError(f"--out {out} already holds a run; choose another directory")
        path = _write_converted_run(hf_dir, out, created)
    finally:
        lock.release()
    print(f"converted {hf_dir} -> {path} (train on with: moefold train --resume {out})")
    return 0


def _write_converted_run(hf_dir: Path, out: Path, created: bool) -> Path:
    """The run of `hf_dir` in `out`, which holds none: its step-0 checkpoint, then config.toml. A
    failure leaves nothing of it: not the directory it made, nor checkpoints without a config.toml
    in one that was there (`--out` would then hold a run that neither resumes nor converts again)."""
    from moefold.checkpoint.dcp import CHECKPOINTS
    from moefold.checkpoint.hf import convert_to_run_checkpoint
    from moefold.files import write_atomically

    try:
        # Tensor by tensor through file-backed storage: the model is never in memory as a whole.
        cfg, path = convert_to_run_checkpoint(hf_dir, out)
        tokenizer = hf_dir / "tokenizer.json"
        if tokenizer.is_file():
            cfg.data.tokenizer = str(tokenizer.resolve())
        config = to_toml(cfg)
        write_atomically(out / "config.toml", lambda tmp: tmp.write_text(config))  # durable, as a training's
    except BaseException:
        shutil.rmtree(out if created else out / CHECKPOINTS, ignore_errors=True)  # locked: nobody else's
        raise
    return path


def _resume_config(resume: Path, overrides: dict[str, Any]) -> tuple[Config, list[str], str]:
    """The config --resume DIR continues with, the notes to say, and where its options come from
    (config.toml, or the config a checkpoint was saved with). A checkpoint's is the one it
    was saved with, which it holds: its run's config.toml holds the options of the run's latest
    start, which a later resume may have changed (as Megatron-LM's --use-checkpoint-args takes
    a checkpoint's). Its data.path and data.tokenizer are config.toml's (`run_data_files`): files
    outside the checkpoint, which a user who moved them sets there. A run directory continues its
    latest checkpoint with config.toml, as does a checkpoint that holds no config (weights only, or
    saved by an earlier moefold): said where it is not the run's latest, whose options config.toml
    may no longer hold."""
    from moefold.checkpoint.dcp import latest_checkpoint, resolve_checkpoint
    from moefold.checkpoint.run_config import run_data_files, saved_config_text, unsaved_options_note

    run_dir = _run_dir_of(resume)
    if not _is_checkpoint_dir(resume):
        return *read_run_config(run_dir / "config.toml", overrides), str(run_dir / "config.toml")
    checkpoint = resolve_checkpoint(resume)
    saved_text = saved_config_text(checkpoint)  # read once: the config and the note compare it
    if saved_text is not None:
        cfg, notes = read_run_config(checkpoint, {**run_data_files(run_dir / "config.toml"), **overrides},
                                     text=saved_text)
        if checkpoint.name == latest_checkpoint(run_dir).name:  # config.toml may hold a start that saved none
            notes += unsaved_options_note(saved_text, checkpoint, run_dir / "config.toml",
                                          f"--resume {resume} continues with", overrides)
        return cfg, notes, f"the config {checkpoint} was saved with"
    cfg, notes = read_run_config(run_dir / "config.toml", overrides)
    if checkpoint.name != latest_checkpoint(run_dir).name:
        notes.append(f"note: --resume {resume} holds no config of its own (weights only, or saved by an earlier "
                     f"moefold): continuing with {run_dir / 'config.toml'}, the options of the run's latest start, "
                     "which may differ from those it was saved with")
    return cfg, notes, str(run_dir / "config.toml")


def _refuse_saved_layout_beyond_the_ranks(resume: Path, cfg: Config, overrides: dict[str, Any], source: str,
                                          nproc: int) -> None:
    """A resume whose saved layout does not fit the ranks started (parallel.ep 2 of a 2-rank run in
    one process; ep 4 on --nproc 2, or on 6 torchrun ranks), said with where the sizes came from
    (`source`) and the sizes that resume it on these ranks: DCP reads a checkpoint under any
    layout. Sizes given now are the user's: `join` and `_spawn_ranks` say those."""
    from moefold.parallel.dims import ParallelDims
    from moefold.parallel.launch import world_from_env

    p = cfg.parallel
    sizes = {f"parallel.{name}": getattr(p, name) for name in ("tp", "cp", "pp", "ep", "etp") if getattr(p, name) > 1}
    world = nproc if nproc != 1 else world_from_env()
    if world < 1 or not sizes or any(key in overrides for key in sizes):
        return
    needed = ParallelDims.smallest(p.tp, p.cp, p.pp, p.ep, p.etp, p.order).world
    if world % needed == 0:
        return  # the sizes fit these ranks (the order's own refusal, if any, is join's)
    fits = " ".join(f"--{key} {size}" for key, size in _sizes_that_fit(world, sizes, p.order).items()
                    if size != sizes[key])
    saved = f"{', '.join(f'{key}={size}' for key, size in sizes.items())} (from {source})"
    if world == 1:
        raise ConfigError(f"--resume {resume}: {saved} needs {needed} ranks and this is one process: start them "
                          f"with --nproc {needed} (or torchrun), or resume on one process with {fits} (a checkpoint "
                          "resumes under another layout)")
    started = f"--nproc {world} starts {world}" if nproc != 1 else f"this job has {world}"
    raise ConfigError(f"--resume {resume}: {saved} needs a multiple of {needed} ranks and {started}: start a "
                      f"multiple of {needed} (--nproc {needed}, or torchrun), or resume on {world} ranks with {fits} "
                      "(a checkpoint resumes under another layout)")


def _sizes_that_fit(world: int, sizes: dict[str, int], order: str) -> dict[str, int]:
    """The parallel sizes (`sizes`: {'parallel.ep': 4, ...}, the others 1) cut down to fit `world`
    ranks, keeping the most parallelism (the largest product; ties: the earlier sizes larger).
    Each a divisor of its saved size, so it still divides what that did (moe.num_experts for ep,
    the heads for tp): every combination is tried, a few dozen for any real layout."""
    import itertools

    from moefold.parallel.dims import ParallelDims

    def fits(combo: tuple[int, ...]) -> bool:
        try:
            ParallelDims(world, **{key.split(".")[1]: size for key, size in zip(sizes, combo)}, order=order)
        except ConfigError:
            return False
        return True

    divisors = [[d for d in range(1, size + 1) if size % d == 0] for size in sizes.values()]
    best = max((combo for combo in itertools.product(*divisors) if fits(combo)),
               key=lambda combo: (math.prod(combo), combo))  # all 1s always fits
    return dict(zip(sizes, best))


def _is_checkpoint_dir(resume: Path) -> bool:
    """Whether --resume DIR (or --run-dir) names one of a run's checkpoints (not the run
    directory), by the name checkpoints are saved under (`step_<N>`, N as saved or as typed,
    which `resolve_checkpoint` maps to the saved name: not a `.tmp` or `.old` leftover)."""
    from moefold.checkpoint.dcp import CHECKPOINTS, is_checkpoint_name

    return is_checkpoint_name(Path(resume).name) and Path(resume).parent.name == CHECKPOINTS


def _run_dir_of(resume: Path, option: str = "--resume") -> Path:
    """The run directory of --resume DIR (or of generate's and convert's --run-dir: `option`), which
    names a run, its checkpoints folder or one of its checkpoints."""
    from moefold.checkpoint.dcp import is_run_dir, refuse_checkpoints_leftover, run_of_checkpoints_folder

    resume = Path(resume)
    if _is_checkpoint_dir(resume):
        run_dir = resume.parent.parent
        if not is_run_dir(run_dir):  # else named as a --config that was never given
            raise UserError(f"{option} {resume}: its run directory {run_dir} holds no config.toml "
                            "(not a moefold run directory)")
        return run_dir
    run_dir = run_of_checkpoints_folder(resume) or resume  # RUN/checkpoints: its latest, as Megatron-LM's --load
    if not is_run_dir(run_dir):
        refuse_checkpoints_leftover(resume, option)
        raise UserError(f"{option} {resume}: not a moefold run directory (no config.toml)")
    return run_dir


def _check_generate_args(args: argparse.Namespace) -> None:
    from moefold.generate import check_sampling  # sample's own checks, naming our flags

    check_sampling(args.max_new_tokens, args.temperature, args.top_k,
                   option=lambda name: "--" + name.replace("_", "-"))
    if not 0 <= args.seed < 2**63:
        raise UserError(f"--seed {args.seed} must be in [0, 2**63) (a torch.Generator's seed)")
    _check_prompt(args.prompt)


def _check_prompt(prompt: str) -> None:
    """Bytes of --prompt that are not UTF-8 reach Python as lone surrogates (PEP 383: U+DC80..U+DCFF
    stand for bytes 0x80..0xFF), which no tokenizer encodes."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(prompt[e.start])
        what = f"byte {code - 0xDC00:#04x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise UserError(f"--prompt is not UTF-8 text: {what} at character {e.start} does not decode; "
                        "give the prompt in UTF-8") from None


def _run_and_checkpoint(run_dir_option: Path) -> tuple[Path, Path]:
    """The run and the checkpoint generate's and convert's --run-dir names, as --resume takes it: a
    run directory or its checkpoints folder (the latest checkpoint), or one of its checkpoints.
    Resolved once, for the config, the weights and the stop or EOS ids: a training may save another
    meanwhile. A directory that is not a run (no config.toml), or whose config.toml does not read,
    is said as such first, not as a run without checkpoints."""
    from moefold.checkpoint.dcp import resolve_checkpoint

    run_dir_option = Path(os.path.abspath(run_dir_option))  # where it is, as _train takes --resume
    run_dir = _run_dir_of(run_dir_option, "--run-dir")
    config_from_toml(run_dir / "config.toml")
    return run_dir, resolve_checkpoint(run_dir_option, "--run-dir")


def _generate(args: argparse.Namespace) -> int:
    import torch

    from moefold.data.tokenizer import build_tokenizer
    from moefold.generate import checkpoint_run_config, continuation, load_model_from_run, sample, stop_ids

    _check_generate_args(args)  # before loading the model
    run_dir, checkpoint = _run_and_checkpoint(args.run_dir)
    cfg, notes = checkpoint_run_config(run_dir, checkpoint, "generate samples with")  # the model it holds, read once
    _say_notes(notes)
    tokenizer = build_tokenizer(cfg.data.tokenizer)  # once, for the prompt and the model
    prompt_ids, context = _prompt_ids(cfg, tokenizer, args.prompt)  # before the weights are read
    model, tokenizer, cfg = load_model_from_run(run_dir, args.device, for_sampling=True, checkpoint=checkpoint,
                                                cfg=cfg, tokenizer=tokenizer)
    generator = torch.Generator().manual_seed(args.seed)
    new_ids = sample(model, prompt_ids, args.max_new_tokens, args.temperature, args.top_k,
                     context, stop_ids(cfg, tokenizer, checkpoint), generator, tokenizer.vocab_size)
    _print_text(continuation(tokenizer, args.prompt, prompt_ids, new_ids))
    return 0


def _say_notes(notes: list[str]) -> None:
    """generate's and convert's notes, on stderr: generate's stdout is the text it samples."""
    for note in notes:
        print(note, file=sys.stderr)


def _prompt_ids(cfg: Config, tokenizer, prompt: str) -> tuple[list[int], int]:
    """--prompt's ids and the model's context, from the run's config (`run_config`) and tokenizer:
    a prompt refused here costs no checkpoint read (a large model's minutes)."""
    from moefold.generate import context_length

    prompt_ids = tokenizer.encode_prompt(prompt)  # as transformers' tokenizer(prompt)
    if not prompt_ids:
        raise UserError(f"--prompt {prompt!r} encodes to no tokens; give text to continue")
    context, source = context_length(cfg)
    if len(prompt_ids) > context:
        raise UserError(f"--prompt is {len(prompt_ids)} tokens, more than the model's context of {context} "
                        f"({source}); shorten it")
    return prompt_ids, context


def _print_text(text: str) -> None:
    """Generated text is any Unicode (U+FFFD for bytes that are not UTF-8): what stdout's encoding
    lacks (a Latin-1 locale, cp1252 when Windows redirects to a file) prints as '?'."""
    encoding = sys.stdout.encoding or "utf-8"
    print(text.encode(encoding, errors="replace").decode(encoding))


def _config(args: argparse.Namespace) -> int:
    if args.config_command == "presets":
        print("\n".join(preset_names()))
        return 0
    cfg = load_config(args.config, _overrides(args))
    if args.config_command == "params":
        from moefold.train.flops import describe_params  # torch import only when needed

        print(describe_params(cfg))
        return 0
    grid = _rank_grid_comment(cfg, args.world_size)  # before printing: it may raise ConfigError
    print(to_toml(cfg) + grid, end="")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from moefold.bench.cli import check_args, run

    check_args(args)  # before building anything
    overrides = _overrides(args)
    return run(args, load_config(args.config, overrides), overrides)


def _plan(args: argparse.Namespace) -> int:
    from moefold.parallel.dims import ParallelDims
    from moefold.plan.devices import DEVICES_GB
    from moefold.plan.memory import predict_memory
    from moefold.plan.report import format_plan

    cfg = load_config(args.config, _overrides(args))
    if args.gpu_memory is not None and not 0 < args.gpu_memory < math.inf:  # None takes --device's
        raise UserError(f"--gpu-memory {args.gpu_memory:g} must be a finite number > 0")
    if args.gpus is not None and args.gpus < 1:
        raise UserError(f"--gpus {args.gpus} must be >= 1")
    p = cfg.parallel
    world = args.gpus or ParallelDims.smallest(p.tp, p.cp, p.pp, p.ep, p.etp, p.order).world
    plan = predict_memory(cfg, world, imbalance=args.moe_imbalance)
    capacity, device = DEVICES_GB[args.device], args.device
    if args.gpu_memory is not None:
        capacity, device = args.gpu_memory, "a GPU"
    print(format_plan(plan, cfg, capacity, device))
    return 0


def _rank_grid_comment(cfg: Config, world_size: int | None) -> str:
    """Both parallel layouts as TOML comments, so `config show` output still loads as a config."""
    from moefold.parallel.dims import ParallelDims, rank_grid  # torch-free

    if world_size is not None and world_size < 1:
        raise UserError(f"--world-size {world_size} must be >= 1")
    p = cfg.parallel
    sizes = (p.tp, p.cp, p.pp, p.ep, p.etp, p.order)
    if world_size is None and max(p.tp, p.cp, p.pp, p.ep, p.etp) == 1:
        return ""  # nothing parallel to show
    dims = ParallelDims(world_size, *sizes) if world_size else ParallelDims.smallest(*sizes)
    return "\n# parallel layout\n" + "".join(f"# {line}\n" for line in rank_grid(dims).splitlines())


def main(argv: list[str] | None = None) -> int:
    try:
        return _run_command(sys.argv[1:] if argv is None else list(argv))
    except KeyboardInterrupt:  # Ctrl-C at any moment, the seconds building the parser takes too
        report("moefold: interrupted")
        return 130
    except BrokenPipeError:  # stdout's reader left (`moefold config show | head -3`): stop quietly
        _silence_stdout()
        return 128 + 13  # as a Unix tool killed by SIGPIPE, which Python ignores


def _silence_stdout() -> None:
    """Points stdout at /dev/null: the interpreter's flush at exit would meet the closed pipe again
    ('Exception ignored ... BrokenPipeError' on stderr)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _run_command(argv: list[str]) -> int:
    parser = _build_parser()  # torch-free (tests/unit/test_cli_startup.py): the commands import it
    try:
        args, unknown = parser.parse_known_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error that _Parser said in one line
        return e.code
    args.argv = argv
    try:
        if unknown:
            _reject_unknown(unknown)
        handler = {"train": _train, "generate": _generate, "convert": _convert,
                   "config": _config, "plan": _plan, "bench": _bench}[args.command]
        return handler(args)
    except UserError as e:
        report(f"moefold: error: {e}")
        return EXIT_USAGE
    except OSError as e:
        if e.errno in FULL_OR_READ_ONLY:
            report(f"moefold: error: writing {e.filename or 'an output'}: {e.strerror}; free space (or "
                   "choose another directory) and run again")
            return EXIT_USAGE
        if not isinstance(e, OutputError):
            raise
        report(f"moefold: error: writing {e.filename}: [Errno {e.errno}] {e.strerror}")  # EIO: not the input
        return EXIT_FAILURE
    except RuntimeError as e:  # torch.OutOfMemoryError on CUDA; a plain RuntimeError on the CPU
        allocation = _failed_allocation(e)
        if allocation is None:
            raise
        report(f"moefold: error: out of memory: {allocation}; a smaller model, micro-batch or "
               "sequence, more GPUs or the memory.* options would fit it (`moefold plan memory` "
               "predicts a GPU's need for the same options)")
        return EXIT_USAGE


def _failed_allocation(error: RuntimeError) -> str | None:
    """What an allocator that ran out of memory failed to allocate, in its words; None for any
    other error. The job asked for more than the machine has: the user's to fix, not a bug."""
    text = str(error)
    if type(error).__name__ == "OutOfMemoryError":  # CUDA: "Tried to allocate 20.00 GiB. GPU 0 ..."
        found = re.search(r"Tried to allocate [\d.]+ \w+\. GPU \d+ has a total capacity of [\d.]+ \w+",
                          text)
        return found.group(0).replace("Tried", "tried") if found else text.splitlines()[0]
    found = re.search(r"can't allocate memory: you tried to allocate (\d+) bytes", text)
    if found is None:
        return None
    return f"tried to allocate {int(found.group(1)) / 2**30:.2f} GiB of the CPU's memory"
