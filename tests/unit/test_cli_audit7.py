"""`moefold train --init-from-hf` and `moefold convert --from-hf` read a checkpoint's config.json
with one reader: the same refusal, naming the file, for the same bad directory."""

import pytest

from moefold.cli import main


def _error_line(capsys, argv):
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("content", [None, b"\xff\xfe{", b"[1, 2]", b"{"],
                         ids=["missing", "not-utf8", "list", "truncated"])
def test_init_from_hf_refuses_a_bad_config_json_as_convert_does(tmp_path, capsys, content):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    if content is not None:
        (hf_dir / "config.json").write_bytes(content)
    converting = _error_line(capsys, ["convert", "--from-hf", str(hf_dir), "--out", str(tmp_path / "run")])
    training = _error_line(capsys, ["train", "--init-from-hf", str(hf_dir), "--run-dir", str(tmp_path / "t")])
    assert str(hf_dir / "config.json") in converting
    assert training == converting
    assert not (tmp_path / "t").exists() and not (tmp_path / "run").exists()
