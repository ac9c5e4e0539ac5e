"""The expert-load heatmap PNG and the bounded history it is drawn from."""

import errno
import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from moefold.checkpoint.dcp import latest_checkpoint
from moefold.cli import main
from moefold.train.heatmap import append_window, relative_load, write_load_heatmap

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"  # the first chunk holds width and height, big-endian
    return struct.unpack(">II", data[16:24])


def history(num_layers: int, num_experts: int, num_windows: int) -> list:
    rng = np.random.default_rng(0)
    return [(10 * (w + 1), rng.integers(0, 50, (num_layers, num_experts)).tolist())
            for w in range(num_windows)]


def test_writes_a_png_of_reasonable_size(tmp_path):
    pytest.importorskip("matplotlib")
    path = write_load_heatmap(history(3, 8, 5), tmp_path / "plots" / "expert_load.png")
    assert path == tmp_path / "plots" / "expert_load.png"
    width, height = png_size(path.read_bytes())
    assert 600 <= width <= 3000 and 200 <= height <= 2500
    assert not list(path.parent.glob("*.tmp"))


def test_many_layers_stay_a_bounded_image(tmp_path):
    pytest.importorskip("matplotlib")
    path = write_load_heatmap(history(64, 16, 3), tmp_path / "expert_load.png")
    width, height = png_size(path.read_bytes())
    assert width <= 3000 and height <= 2500


def test_without_matplotlib_returns_none(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # makes the import fail
    assert write_load_heatmap(history(2, 8, 2), tmp_path / "x.png") is None
    assert not (tmp_path / "x.png").exists()


def test_empty_history_writes_nothing(tmp_path):
    assert write_load_heatmap([], tmp_path / "x.png") is None
    assert not (tmp_path / "x.png").exists()


def test_relative_load_is_one_for_an_even_share_and_zero_for_an_idle_layer():
    load_L_EW = relative_load([(1, [[2, 2, 4, 0], [0, 0, 0, 0]])])
    # Layer 0: 8 tokens over 4 experts, even share 2 → [1, 1, 2, 0]; layer 1 saw none → zeros.
    assert load_L_EW[0][:, 0].tolist() == [1.0, 1.0, 2.0, 0.0]
    assert load_L_EW[1][:, 0].tolist() == [0.0] * 4


def test_append_window_merges_pairs_past_the_limit():
    h = []
    for step in range(1, 6):
        append_window(h, step, [[step, 1]], max_windows=4)
    # The 5th window overflows 4: (1,2) → step 2, (3,4) → step 4, 5 stays.
    assert h == [(2, [[3, 2]]), (4, [[7, 2]]), (5, [[5, 1]])]


def _matplotlib_that_saves(monkeypatch, savefig) -> None:
    """A stand-in for the two matplotlib classes the heatmap imports (matplotlib is optional and
    absent on the test machine): a figure whose `savefig(file, **options)` is `savefig(file)`;
    nothing is drawn."""
    import types

    import moefold.train.heatmap as heatmap

    class Figure:
        def __init__(self, figsize):
            pass

        def savefig(self, file, **options):
            savefig(Path(file))

    figure, agg = types.ModuleType("matplotlib.figure"), types.ModuleType("matplotlib.backends.backend_agg")
    figure.Figure, agg.FigureCanvasAgg = Figure, lambda fig: None
    for name, module in {"matplotlib": types.ModuleType("matplotlib"), "matplotlib.figure": figure,
                         "matplotlib.backends": types.ModuleType("matplotlib.backends"),
                         "matplotlib.backends.backend_agg": agg}.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(heatmap, "_draw", lambda *args: None)


def test_the_png_is_flushed_to_disk_before_its_rename_and_its_directory_after(tmp_path, monkeypatch,
                                                                              durability_events):
    """Renamed unflushed, a power cut soon after could leave expert_load.png empty (ext4 and XFS
    may write the rename before the data): it is made durable as checkpoints and config.toml are."""
    _matplotlib_that_saves(monkeypatch, lambda file: file.write_bytes(PNG_SIGNATURE))
    plots = tmp_path.resolve() / "plots"  # as /proc/self/fd names the files
    events = durability_events
    path = write_load_heatmap(history(2, 4, 3), plots / "expert_load.png")
    tmp = plots / "expert_load.png.tmp"
    assert events == [("fsync", tmp), ("replace", tmp, path), ("fsync", plots)]
    assert path.read_bytes() == PNG_SIGNATURE


def test_an_io_error_drawing_the_heatmap_is_one_line_naming_it_and_keeps_the_run(tmp_path, tiny_args, capsys,
                                                                               monkeypatch):
    """EIO while the heatmap is written, at the end of a run, ended it in a traceback: one line
    names the file and the OS error, status 1 (the storage failed, not the input); the final
    checkpoint and every metrics record were written before it, and no partial PNG is left."""
    def failing_disk(file):
        file.write_bytes(PNG_SIGNATURE[:4])
        raise OSError(errno.EIO, "Input/output error")

    _matplotlib_that_saves(monkeypatch, failing_disk)
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *tiny_args, "--logging.expert_load_heatmap", "true"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"moefold: error: writing {run / 'expert_load.png'}: [Errno {errno.EIO}] Input/output error"]
    assert not list(run.glob("expert_load.png*"))
    assert latest_checkpoint(run).name == "step_00000012"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 13))
