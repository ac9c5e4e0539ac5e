"""docs/python.md's examples run as written: its ```python blocks, in order, in one namespace (a
later block may use what an earlier one made, as a reader in one session would), in a fresh
directory. The checks after them are on what the page says the calls do."""
import math
import re
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parents[2] / "docs" / "python.md"


def _python_blocks(text: str) -> list[str]:
    """Each block's code, preceded by blank lines so that a traceback names the page's line."""
    return ["\n" * text.count("\n", 0, m.start(1)) + m.group(1)
            for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M)]


def test_the_python_page_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    blocks = _python_blocks(DOC.read_text())
    assert len(blocks) == 6, "a block was added or lost: keep this test's checks in step"
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)
    ns = namespace
    # Train, then resume: the last log step's metrics, checkpoints of both runs.
    assert ns["last"]["step"] == 6 and math.isfinite(ns["last"]["loss"])
    checkpoints = tmp_path / "runs/from-python/checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000004", "step_00000006"]
    # Own loop: the MTP model's objective reports both parts.
    assert set(ns["parts"]) == {"lm_loss", "mtp_loss"}
    # MoE layer: 2 · 16 tokens · top-2 routed copies counted, and the expert bias moved.
    assert ns["layer"].stats.tokens_E.sum().item() == 2 * 16 * 2
    assert ns["layer"].router.expert_bias_E.abs().sum().item() > 0
    assert ns["x_BSD"].grad is not None and torch.isfinite(ns["x_BSD"].grad).all()
    # Recompute in backward: the recompute counts nothing a second time.
    assert ns["recomputed"].stats.tokens_E.sum().item() == 2 * 16 * 2
    assert ns["h_BSD"].grad is not None and torch.isfinite(ns["h_BSD"].grad).all()
    # Sampling: new tokens after the prompt.
    assert 0 < len(ns["new_ids"]) <= 20
    assert "def main(" in capsys.readouterr().out
