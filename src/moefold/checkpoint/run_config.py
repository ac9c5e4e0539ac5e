"""The config a training checkpoint was saved with: its run's config.toml as it stood at the save,
which the checkpoint holds as TOML text under `CONFIG_KEY`. A run's config.toml holds the options
of its latest start, which a later resume may have changed; a checkpoint's own says what its
weights are (as Megatron-LM's --use-checkpoint-args reads a checkpoint's arguments). The files
outside the checkpoint (`RUN_DATA_FILES`) are config.toml's: where a user who moved them sets them
(as Megatron-LM takes data paths from the command line, not the checkpoint)."""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Collection
from pathlib import Path
from typing import Any

from moefold.checkpoint.dcp import checkpoint_keys, load_value
from moefold.config import SECTIONS, Config, apply_overrides, flatten_table, read_preset, read_run_config
from moefold.errors import ConfigError

CONFIG_KEY = "config"
"""A checkpoint's key for the config it was saved with (config.toml's text)."""

RUN_DATA_FILES = ("data.path", "data.tokenizer")
"""[data] options naming files outside the checkpoint, taken from the run's config.toml: the data
checks of a resume (sequences, fingerprint) say whether they still hold the data it trained on."""


def saved_config_text(checkpoint: Path) -> str | None:
    """The TOML text of the config `checkpoint` was saved with; None where it holds none (weights
    only, or saved by an earlier moefold)."""
    return load_value(checkpoint, CONFIG_KEY) if CONFIG_KEY in checkpoint_keys(checkpoint) else None


def saved_config(checkpoint: Path, overrides: dict[str, Any] | None = None) -> tuple[Config, list[str]] | None:
    """The config `checkpoint` was saved with, `overrides` on top, and `read_run_config`'s notes
    (options an older moefold saved that the config now refuses, dropped); None where it holds none."""
    text = saved_config_text(checkpoint)
    return None if text is None else read_run_config(checkpoint, overrides, text=text)


def run_data_files(config_path: Path) -> dict[str, Any]:
    """`RUN_DATA_FILES` as a run's config.toml (`config_path`) gives them, checked there (its
    errors name it), as overrides of a checkpoint's config (`saved_config`)."""
    label = str(config_path)
    table = flatten_table(read_preset(label, label), label)
    given = {key: table[key] for key in RUN_DATA_FILES if key in table}
    cfg = Config()
    apply_overrides(cfg, given, source=label)
    return {key: getattr(cfg.data, key.split(".")[1]) for key in given}


def unsaved_options(saved_text: str, checkpoint: Path, config_path: Path) -> list[tuple[str, Any, Any]]:
    """(key, config.toml's value, the checkpoint's) for each option its run's config.toml
    (`config_path`) gives otherwise than the config `checkpoint` was saved with (`saved_text`, its
    `saved_config_text`), the files outside it aside (`RUN_DATA_FILES`). At the run's latest
    checkpoint these are a later start's that never saved (stopped or killed before its first
    checkpoint)."""
    try:
        held = _sections(unvalidated_config(tomllib.loads(saved_text), str(checkpoint)))
        given = _sections(unvalidated_config(read_preset(str(config_path), str(config_path)), str(config_path)))
    except ConfigError:  # an option an earlier moefold saved and this one no longer knows: no note, no refusal
        return []
    return [(f"{section}.{name}", value, held[section][name]) for section in SECTIONS
            for name, value in given[section].items()
            if value != held[section][name] and f"{section}.{name}" not in RUN_DATA_FILES]


def unsaved_options_note(saved_text: str, checkpoint: Path, config_path: Path, continues: str,
                         given: Collection[str] = ()) -> list[str]:
    """One line where the run's config.toml (`config_path`) holds options its latest checkpoint
    was not saved with (`unsaved_options`): a later start stopped before its first save, whose
    options a user of that checkpoint (`continues`: '--resume CKPT continues with', 'generate
    samples with') does not take. The options `given` now (a resume's overrides) aside."""
    unsaved = [(key, value, held) for key, value, held in unsaved_options(saved_text, checkpoint, config_path)
               if key not in given]
    if not unsaved:
        return []
    return [f"note: {config_path} holds options its latest checkpoint was not saved with (a start that saved "
            f"none): {', '.join(f'{key}={value!r}' for key, value, _ in unsaved)}; {continues} its own: "
            f"{', '.join(f'{key}={held!r}' for key, _, held in unsaved)}"]


def unvalidated_config(table: dict[str, Any], label: str) -> Config:
    """A saved TOML table (a checkpoint's config, a run's config.toml) over the defaults, without
    `validate`: the options a run held, to compare with, as an earlier moefold may have saved them."""
    cfg = Config()
    apply_overrides(cfg, flatten_table(table, label), source=label)
    return cfg


def _sections(cfg: Config) -> dict[str, dict[str, Any]]:
    """`cfg` as {section: {name: value}} over every field."""
    return {section: dataclasses.asdict(getattr(cfg, section)) for section in SECTIONS}
