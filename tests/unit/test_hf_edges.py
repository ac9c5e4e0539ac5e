"""Hugging Face interop at its edges: checkpoints and configs that are damaged or unusual, each
refused in one line naming the file and tensor (or loaded exactly as transformers loads them)."""

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from test_hf_interop import hf_model_of, qwen3  # noqa: E402

from moefold.checkpoint.hf import INDEX, load_pretrained, pretrained_on_meta  # noqa: E402
from moefold.cli import main  # noqa: E402
from moefold.errors import CheckpointError  # noqa: E402


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint in several shards with an index, as transformers writes it."""
    path = tmp_path_factory.mktemp("sharded") / "hf"
    hf_model_of(qwen3()).save_pretrained(path, max_shard_size="20KB")
    assert (path / INDEX).is_file()
    return path


def test_an_index_naming_a_shard_without_the_tensor_is_a_one_line_error(sharded, tmp_path, capsys):
    """An index out of date with its shards (one re-sharded, or copied from another download) sends
    a tensor to a file that does not hold it: refused from the files' headers, naming both, not a
    SafetensorError traceback when the tensor is read."""
    path = shutil.copytree(sharded, tmp_path / "hf")
    index = json.loads((path / INDEX).read_text())
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][name])
    index["weight_map"][name] = other
    (path / INDEX).write_text(json.dumps(index))
    message = f"{INDEX} puts {name} in {other}, which does not hold it"
    with pytest.raises(CheckpointError, match=message):
        pretrained_on_meta(path)  # before any weight is allocated: every rank refuses it alike
    with pytest.raises(CheckpointError, match=message):
        load_pretrained(path)
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(path), "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not run.exists()
