"""The config a training checkpoint was saved with: its run's config.toml as it stood at the save,
which the checkpoint holds as TOML text under `CONFIG_KEY`. A run's config.toml holds the options
of its latest start, which a later resume may have changed; a checkpoint's own says what its
weights are (as Megatron-LM's --use-checkpoint-args reads a checkpoint's arguments)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moefold.checkpoint.dcp import checkpoint_keys, load_value
from moefold.config import Config, read_run_config

CONFIG_KEY = "config"
"""A checkpoint's key for the config it was saved with (config.toml's text)."""


def saved_config_text(checkpoint: Path) -> str | None:
    """The TOML text of the config `checkpoint` was saved with; None where it holds none (weights
    only, or saved by an earlier moefold)."""
    return load_value(checkpoint, CONFIG_KEY) if CONFIG_KEY in checkpoint_keys(checkpoint) else None


def saved_config(checkpoint: Path, overrides: dict[str, Any] | None = None) -> tuple[Config, list[str]] | None:
    """The config `checkpoint` was saved with, `overrides` on top, and `read_run_config`'s notes
    (options an older moefold saved that the config now refuses, dropped); None where it holds none."""
    text = saved_config_text(checkpoint)
    return None if text is None else read_run_config(checkpoint, overrides, text=text)
