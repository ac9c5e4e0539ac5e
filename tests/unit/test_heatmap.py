"""The expert-load heatmap PNG and the bounded history it is drawn from."""

import struct
import sys

import numpy as np
import pytest

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
