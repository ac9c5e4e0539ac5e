"""Hugging Face interop at its edges: checkpoints and configs that are damaged or unusual, each
refused in one line naming the file and tensor (or loaded exactly as transformers loads them)."""

import errno
import json
import re
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


@pytest.mark.parametrize("unreadable", ["config.json", INDEX, "model-00002-of-00012.safetensors"])
def test_a_checkpoint_file_that_cannot_be_read_is_a_one_line_error(unreadable, sharded, tmp_path, capsys,
                                                                    monkeypatch):
    """Permission denied (a download another user owns) on config.json, the index or a shard: a
    one-line error naming the file, exit 2, as data files are; not an OSError traceback. safetensors
    raises a bare OSError (no errno) when it cannot open a file."""
    import safetensors

    path = shutil.copytree(sharded, tmp_path / "hf")
    denied = path / unreadable
    real_read_text, real_safe_open = Path.read_text, safetensors.safe_open

    def read_text(self, *args, **kwargs):
        if self == denied:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_read_text(self, *args, **kwargs)

    def safe_open(file, *args, **kwargs):
        if Path(file) == denied:
            raise OSError("Permission denied (os error 13)")
        return real_safe_open(file, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    monkeypatch.setattr(safetensors, "safe_open", safe_open)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(denied))}: cannot be read \(Permission denied"):
        load_pretrained(path)
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(path), "--out", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{denied}: cannot be read (Permission denied" in err[0]
    assert not run.exists()


@pytest.mark.parametrize("file, content", [
    ("config.json", "{}".encode("utf-16")),  # as PowerShell's Out-File writes it
    ("config.json", b"[]"),
    (INDEX, b'["model-00001-of-00012.safetensors"]'),
])
def test_a_json_file_that_is_no_json_object_is_a_one_line_error(file, content, sharded, tmp_path, capsys):
    """config.json or the index in another encoding than UTF-8, or a JSON value that is not an
    object: one line naming the file, exit 2; not a UnicodeDecodeError or AttributeError traceback.
    `train --init-from-hf` reads config.json on its own path and refuses it alike."""
    path = shutil.copytree(sharded, tmp_path / "hf")
    (path / file).write_bytes(content)
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(path), "--out", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and (f"{path / file}: invalid JSON" in err[0] or "not a JSON object" in err[0]), err
    assert not run.exists()
    if file == "config.json":
        assert main(["train", "--init-from-hf", str(path), "--run-dir", str(run)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "config.json" in err[0], err
        assert not run.exists()
