"""Sampling from a run's checkpoint (its latest, or one named), with a KV cache: the prompt is read
once, then each new token alone (`Transformer.decode`)."""

import dataclasses
from collections.abc import Callable, Collection
from pathlib import Path

import torch

from moefold.checkpoint.dcp import checkpoint_step, latest_checkpoint, load_weights, resolve_checkpoint
from moefold.checkpoint.hf import stop_token_ids
from moefold.checkpoint.run_config import run_data_files, saved_config_text, unsaved_options_note
from moefold.config import Config, config_from_toml, read_run_config
from moefold.data.formats import TOKEN_SUFFIXES, find_data_files
from moefold.data.tokenizer import build_tokenizer
from moefold.errors import CheckpointError, DataError, UserError
from moefold.models.transformer import build_model, materialize
from moefold.moe.router import RoundRobinSelection
from moefold.parallel.launch import resolve_device
from moefold.train.trainer import resolve_compute_dtype


def load_model_from_run(run_dir: Path, device_name: str = "auto", exact_masters: bool = False,
                        for_sampling: bool = False, checkpoint: Path | None = None, cfg: Config | None = None,
                        tokenizer=None):
    """(model, tokenizer, config) with the weights of the run's latest checkpoint, or of
    `checkpoint` (one of its checkpoints: `moefold generate` resolves the one it reads once, for
    these weights and for `stop_ids`, since a training may save another in between), built with the
    config that checkpoint was saved with (`run_config`); the model is
    dropless and unpadded whatever capacity factor and pad multiple the run trained with
    (`_dropless`). `cfg`: `run_config(run_dir, checkpoint)` where the caller has read it already
    (`moefold generate` encodes the prompt with it first); `tokenizer`:
    `build_tokenizer(cfg.data.tokenizer)` where the caller has built it already (`moefold
    generate`'s, for the prompt: a tokenizer.json is read once). `exact_masters`: as
    `load_weights`' (an export's weights, not the ones a bf16 forward ran with). `for_sampling`: a tokenizer of more
    ids than the model's is refused first (`check_tokenizer_fits`); an export takes the weights
    whatever the tokenizer."""
    checkpoint = resolve_checkpoint(Path(checkpoint or run_dir), "--run-dir")
    cfg = cfg if cfg is not None else run_config(run_dir, checkpoint)
    device = resolve_device(device_name, "--device")
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer(cfg.data.tokenizer)
    if for_sampling:  # before the weights are read
        check_tokenizer_fits(run_dir, cfg, tokenizer, cfg.model.vocab_size or tokenizer.vocab_size)
        _check_token_files_have_tokenizer(run_dir, cfg, tokenizer)
    with torch.device("meta"):  # the checkpoint is read straight into the device's tensors
        model = build_model(_dropless(cfg), cfg.model.vocab_size or tokenizer.vocab_size, device.type,
                            resolve_compute_dtype(cfg.precision.compute_dtype, device))
    materialize(model, device)
    load_weights(model, checkpoint, exact_masters)
    return model.eval(), tokenizer, cfg


def run_config(run_dir: Path, checkpoint: Path | None = None) -> Config:
    """The config of run directory `run_dir`: its config.toml; with `checkpoint` (one of its
    checkpoints), the config of the model that checkpoint holds. That is the one it was saved with
    (`saved_config`), which config.toml, rewritten as each training starts, may no longer be: a
    `--resume --moe.top_k 3` stopped before its first save left top_k 3 beside a top_k-2 model.
    config.toml's serves a checkpoint that holds none (a conversion's weights only, or one saved by
    an earlier moefold). data.tokenizer and data.path are config.toml's in both (`run_data_files`):
    files outside the checkpoint, which the user sets there (moved, or a tokenizer missing from a
    run on token files: the refusals here say to). A resume that changes them over text data
    changes the tokens, which the data checks refuse before config.toml is rewritten. `checkpoint`
    is named as `load_model_from_run`'s: `step_2` is the saved `step_00000002`."""
    config_path = run_config_path(run_dir)  # a non-run is said as such first
    if checkpoint is None:
        return config_from_toml(config_path)
    checkpoint = resolve_checkpoint(Path(checkpoint), "--run-dir")
    return _checkpoint_config(config_path, checkpoint, saved_config_text(checkpoint))


def checkpoint_run_config(run_dir: Path, checkpoint: Path, command: str) -> tuple[Config, list[str]]:
    """`run_config` of `checkpoint`, the one of the run's checkpoints that `moefold generate` or
    `convert --to-hf` reads (its latest, or one named), and the note a `--resume` of it says. At
    the latest: the options config.toml holds that it was not saved with (a start that saved none:
    `unsaved_options_note`), which `command` ('generate samples with') does not take. At an
    earlier one without a config of its own: config.toml's serve, which a later start may have
    changed. The checkpoint's config is read once, for both."""
    config_path = run_config_path(run_dir)
    saved_text = saved_config_text(checkpoint)
    cfg = _checkpoint_config(config_path, checkpoint, saved_text)
    latest = latest_checkpoint(run_dir)
    if latest is not None and checkpoint.name == latest.name:
        return cfg, [] if saved_text is None else unsaved_options_note(saved_text, checkpoint, config_path, command)
    if saved_text is not None:
        return cfg, []  # config.toml's options may be a later start's, which this checkpoint did not train with
    return cfg, [f"note: --run-dir {checkpoint} holds no config of its own (weights only, or saved by an earlier "
                 f"moefold): its model is built with {config_path}, the options of the run's latest start, which "
                 "may differ from those it was saved with"]


def _checkpoint_config(config_path: Path, checkpoint: Path | None, saved_text: str | None) -> Config:
    """`run_config` from the run's config.toml and the config `checkpoint` was saved with (its
    `saved_config_text`; None: config.toml's serves)."""
    if saved_text is None:
        return config_from_toml(config_path)
    cfg, _ = read_run_config(checkpoint, run_data_files(config_path), text=saved_text)
    return cfg  # its notes (options dropped since, which have no effect) are said by a resume, not here


def run_config_path(run_dir: Path) -> Path:
    """`run_dir`'s config.toml; refused where it has none: not a run directory, whatever else it
    holds (said before its checkpoints are looked for)."""
    config_path = Path(run_dir) / "config.toml"
    if not config_path.is_file():
        raise CheckpointError(f"--run-dir {run_dir}: no config.toml (not a moefold run directory)")
    return config_path


def check_tokenizer_fits(run_dir: Path, cfg: Config, tokenizer, model_vocab: int) -> None:
    """Refuses a tokenizer of more ids than the model's vocabulary: they are not the model's tokens
    (a run converted from a checkpoint without tokenizer.json has the byte tokenizer's 257), and
    sampling would index past the embedding, or read and write the model's ids as other text."""
    if tokenizer.vocab_size > model_vocab:
        which = repr(cfg.data.tokenizer) + ("" if cfg.data.tokenizer else ", the byte-level one")
        raise UserError(f"--run-dir {run_dir}: the model's vocabulary has {model_vocab} ids, its tokenizer "
                        f"(data.tokenizer={which}) {tokenizer.vocab_size}; set data.tokenizer in its "
                        "config.toml to the model's tokenizer.json")


def _check_token_files_have_tokenizer(run_dir: Path, cfg: Config, tokenizer) -> None:
    """Refuses a run trained on token files of more ids than the byte tokenizer's, without the
    tokenizer that made them: a prompt's bytes would be read as other tokens and the sampled ids
    cut to 257 and printed as bytes. Files of ids that fit (byte-level ones) stay allowed."""
    if cfg.data.tokenizer or cfg.model.vocab_size <= tokenizer.vocab_size or not _trained_on_token_files(cfg):
        return
    raise UserError(f"--run-dir {run_dir}: trained on token files (data.path={cfg.data.path}) of "
                    f"{cfg.model.vocab_size} ids without their tokenizer: --prompt's bytes are not its tokens; "
                    "set data.tokenizer in its config.toml to the tokenizer.json that made them")


def _trained_on_token_files(cfg: Config) -> bool:
    """Whether data.path names .npy/.bin token files (a directory of them: as the run found them)."""
    if not cfg.data.path:
        return False
    if Path(cfg.data.path).suffix.lower() in TOKEN_SUFFIXES:
        return True
    try:
        files = find_data_files(cfg.data.path)
    except DataError:  # gone, or unreadable here: no evidence
        return False
    return bool(files) and files[0].is_tokens


def end_of_document_id(cfg: Config, tokenizer) -> int:
    """The id that ended the run's training documents, where generation stops: data.eos_id where
    the run's token files set it, else the tokenizer's EOS (as data/corpus.py reads them)."""
    return cfg.data.eos_id if cfg.data.eos_id >= 0 else tokenizer.eos_id


def learned_end_of_document_id(cfg: Config, tokenizer, vocab_size: int, run_dir: Path) -> int | None:
    """`end_of_document_id` where the run's model may have learned it, else None: the byte
    tokenizer's 256 ended no document that a run converted from a checkpoint without tokenizer.json
    read before it trained (its step-0 checkpoint), and an id past the vocabulary is no token.
    `run_dir`: the run (its latest checkpoint), or the checkpoint whose weights the model holds."""
    eos = end_of_document_id(cfg, tokenizer)
    bytes_untrained = (not cfg.data.tokenizer and cfg.data.eos_id < 0
                       and checkpoint_step(resolve_checkpoint(run_dir, "--run-dir")) == 0)
    return None if bytes_untrained or eos >= vocab_size else eos


def stop_ids(cfg: Config, tokenizer, run_dir: Path) -> list[int]:
    """The ids `moefold generate` stops at for run directory `run_dir` (or the checkpoint of it
    whose weights the model holds): the end of document where
    its model learned it (`learned_end_of_document_id`), and those an imported checkpoint states,
    where transformers' generate stops (its generation_config.json's eos_token_id, else its
    config.json's: Qwen3 instruct's <|im_end|> and <|endoftext|>)."""
    return stop_token_ids(cfg, learned_end_of_document_id(cfg, tokenizer, tokenizer.vocab_size, run_dir))


def context_length(cfg: Config) -> tuple[int, str]:
    """The positions the model reads at once, and the option that sets them: the context the model
    states (`ModelConfig.stated_context`: an imported checkpoint's, or YaRN's), else train.seq_len
    (what a native run trained at; a converted run's is the default 256, not the model's context)."""
    return cfg.model.stated_context() or (cfg.train.seq_len, "train.seq_len")


def _dropless(cfg: Config) -> Config:
    """`cfg` without a capacity factor or padded expert rows. Capacity drops a token by what else is
    in the same forward (the prompt, a decode call): a generated token would depend on how its
    context was read, and the cache's logits would differ from a full forward's. Every token reaches
    its experts. moe.pad_multiple (FP8 kernels' alignment) gave each expert up to m − 1 zero rows:
    E·(m − 1) rows of expert GEMMs for a decode step's K copies, changing no output."""
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, capacity_factor=0.0, pad_to_capacity=False,
                                                            pad_multiple=0))


@torch.no_grad()
def sample(model, prompt_ids: list[int], max_new_tokens: int, temperature: float, top_k: int,
           context: int, eos_id: int | Collection[int], generator: torch.Generator,
           vocab_size: int | None = None) -> list[int]:
    """Autoregressive sampling; stops at max_new_tokens or at `eos_id`, an id or several
    (`stop_ids`), which is not returned. `context`: the
    positions the model reads at once (`context_length`); a longer prompt is refused, never cut.
    Once prompt and new tokens fill it, each further token re-reads the `context` tokens that end
    with it at positions 0.., as without a cache. `vocab_size`: the tokenizer's; the rows a
    model.vocab_size padded beyond it are never sampled (None: every row). Options `moefold
    generate` refuses are refused here with its messages (`check_sampling`), as is a `context`
    below 1 or shorter than the prompt, an empty prompt (the model has no beginning-of-sequence
    token to start from), an id outside the model's vocabulary, a `vocab_size` outside [1, model.vocab_size],
    a model with a capacity factor (`_check_dropless`) and one that routes round-robin
    (`_check_routes_by_router`). The model
    runs in eval mode, whatever its own (restored after): generation never counts toward a
    training step's routing statistics."""
    check_sampling(max_new_tokens, temperature, top_k)
    if context < 1:
        raise UserError(f"sample: context {context} must be >= 1 (the tokens the model reads at "
                        "once: context_length(cfg))")
    if len(prompt_ids) == 0:
        raise UserError("sample: prompt_ids is empty; give at least one token to continue (the "
                        "model has no beginning-of-sequence token to start from)")
    if len(prompt_ids) > context:  # transformers never drops prompt tokens either
        raise UserError(f"sample: prompt_ids holds {len(prompt_ids)} tokens, more than context {context}")
    _check_ids(prompt_ids, model.vocab_size)
    if vocab_size is not None and not 1 <= vocab_size <= model.vocab_size:  # the logits are cut to it
        raise UserError(f"sample: vocab_size {vocab_size} (the tokenizer's) must be in [1, {model.vocab_size}], "
                        "the model's vocabulary")
    _check_dropless(model)
    _check_routes_by_router(model)
    was_training = model.training
    # In training mode the MoE layers would jitter the router input and add the generated
    # tokens to the step's counts (the expert-bias update, the statistics): eval, then restore.
    model.eval()
    try:
        stops = set(eos_id) if isinstance(eos_id, Collection) else {eos_id}
        return _generate(model, list(prompt_ids), max_new_tokens, temperature, top_k, context, stops,
                         generator, vocab_size)
    finally:
        model.train(was_training)


def _generate(model, ids: list[int], max_new_tokens: int, temperature: float, top_k: int, context: int,
              stops: set[int], generator: torch.Generator, vocab_size: int | None) -> list[int]:
    """`sample`'s loop, the model in eval mode: the new ids after `ids`."""
    device, prompt_len = next(model.parameters()).device, len(ids)
    # No larger than the sequence needs: a context of 40960 positions would be allocated whole.
    window = min(context, prompt_len + max_new_tokens)
    cache, unread = model.new_cache(window), ids
    for _ in range(max_new_tokens):
        next_id = _pick(_read(model, unread, cache, device)[:vocab_size], temperature, top_k, generator)
        if next_id in stops:
            break
        ids.append(next_id)
        unread = [next_id]
        if cache.length == context:  # full: the window moves on by one, read anew
            cache, unread = model.new_cache(window), ids[-context:]
    return ids[prompt_len:]


def _check_ids(prompt_ids: list[int], vocab_size: int) -> None:
    """Refuses an id the embedding has no row for (else torch's IndexError, or on a GPU a device
    assert that poisons the CUDA context)."""
    outside = [i for i in prompt_ids if not 0 <= i < vocab_size]
    if outside:
        raise UserError(f"sample: prompt_ids holds {outside[0]}, outside the model's vocabulary "
                        f"[0, {vocab_size})")


def _check_dropless(model) -> None:
    """Refuses a model whose MoE layers drop tokens: the cache reads the prompt at once, then one
    token at a time (never a drop), so what a token's context kept would depend on how it was
    read, and sampling would differ from full forwards and from `moefold generate`'s model."""
    factors = {layer.capacity.capacity_factor for layer in model.moe_layers()} - {0.0}
    if factors:
        raise UserError(f"sample: the model drops tokens past its experts' capacity (moe.capacity_factor="
                        f"{max(factors)}): a generated token would depend on how its context was read; "
                        "build it with moe.capacity_factor=0 (load_model_from_run does)")


def _check_routes_by_router(model) -> None:
    """Refuses round-robin routing (moe.force_balanced): it sends a token to experts by its place
    in the forward, not by the router, and the cache reads each new token alone (always the
    first experts), so sampling would differ from full forwards of the same context."""
    selections = [layer.router.select for layer in model.moe_layers()]
    # ReplayedSelection (router replay) wraps the model's own selection as `.select`
    if any(isinstance(getattr(s, "select", s), RoundRobinSelection) for s in selections):
        raise UserError("sample: the model routes tokens round-robin by their place in the forward "
                        "(moe.force_balanced=true, for benchmarks), not by its router: a generated "
                        "token's experts would depend on how its context was read; generate from a "
                        "model trained with moe.force_balanced=false")


def check_sampling(max_new_tokens: int, temperature: float, top_k: int,
                   option: Callable[[str], str] = lambda name: f"sample: {name}") -> None:
    """Refuses what `sample` cannot do, in one line that names the option as the caller spells it:
    `option` maps `sample`'s parameter name to it (`moefold generate` passes its flags' names)."""
    if max_new_tokens < 0:
        raise UserError(f"{option('max_new_tokens')} {max_new_tokens} must be >= 0")
    if not temperature >= 0:  # NaN too
        raise UserError(f"{option('temperature')} {temperature} must be >= 0 (0 is greedy)")
    if top_k < 0:
        raise UserError(f"{option('top_k')} {top_k} must be >= 0 (0 samples among all tokens)")


def _read(model, ids: list[int], cache, device) -> torch.Tensor:
    """The next token's logits after the model reads `ids` into `cache` (the head reads the last
    position only)."""
    return model.decode(torch.tensor([ids], device=device), cache, logits_to_keep=1)[0, -1].float()


def _pick(logits_V: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    if bool(logits_V.isnan().any()):  # a diverged model: argmax would pick the NaN, multinomial fail
        raise UserError(f"sample: the model's next-token logits hold NaN ({int(logits_V.isnan().sum())} of "
                        f"{logits_V.numel()}): its weights hold NaN or inf (a diverged checkpoint)")
    if temperature <= 0:
        return int(logits_V.argmax())
    if 0 < top_k < logits_V.numel():  # before the temperature, which may flatten every logit to 0
        kth = torch.topk(logits_V, top_k).values[-1]
        logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
    # Shifted to a maximum of 0, in fp64 (any positive float temperature is nonzero there): a tiny
    # temperature sends the others to -inf (greedy) where dividing first overflowed to inf and the
    # softmax to nan; masked logits stay -inf at an infinite one. A +inf logit (an fp16 head's
    # overflow) is the maximum, 0, not inf - inf = nan: the softmax's limit, all mass on it.
    top = logits_V.max()
    shifted_V = torch.where(logits_V == top, 0.0, logits_V.double() - top)
    scaled_V = torch.where(torch.isfinite(shifted_V), shifted_V / temperature, float("-inf"))
    probs_V = scaled_V.softmax(-1).cpu()
    return int(torch.multinomial(probs_V, 1, generator=generator))


def continuation(tokenizer, prompt: str, prompt_ids: list[int], new_ids: list[int]) -> str:
    """`prompt` followed by the sampled text. Decoded with the prompt's ids: tokenizers that mark
    a word's start in its token (SentencePiece's ▁, Llama/Mistral style) drop the space of a first
    token decoded alone; where decoding does not give the prompt back verbatim (normalization),
    the whole decoded text."""
    text, head = tokenizer.decode(prompt_ids + new_ids), tokenizer.decode(prompt_ids)
    return prompt + text[len(head):] if text.startswith(head) else text
