"""A new user's walkthrough of README.md and docs/*.md (benchmarks.md aside), audit 15: what the
pages state that the other docs tests did not check yet, checked against the code, each in the
style of tests/unit/test_docs_audit.py (cheap: no training)."""
import re
from pathlib import Path

from moefold.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _plan(argv: list[str], capsys) -> str:
    capsys.readouterr()
    assert main(["plan", "memory", *argv]) == 0
    return capsys.readouterr().out


def _row(out: str, label: str) -> float:
    return float(re.search(rf"^ *{re.escape(label)} +([\d.]+)$", out, re.M).group(1))


def test_memory_md_sequence_parallel_figures_are_the_plans(capsys):
    """docs/memory.md's Qwen3-30B-A3B at tp 4, ep 8, 4 × 4096: norms and router with and without
    sequence parallelism, and the peak it says the plan gives now."""
    text = " ".join((ROOT / "docs/memory.md").read_text().split())
    m = re.search(r"Qwen3-30B-A3B at tp 4, ep 8, 4 × 4096: ([\d.]+) GiB of norms per GPU with sequence "
                  r"parallelism, ([\d.]+) without; ([\d.]+) GiB of router with it, ([\d.]+) without \(.*?"
                  r"now ([\d.]+)", text)
    layout = ["--config", "qwen3-30b-a3b", "--parallel.tp", "4", "--parallel.ep", "8",
              "--train.micro_batch_size", "4", "--train.seq_len", "4096"]
    with_sp = _plan([*layout, "--parallel.sequence_parallel", "true"], capsys)
    without = _plan([*layout, "--parallel.sequence_parallel", "false"], capsys)
    assert f"{_row(with_sp, 'norms (fp32 RMSNorm)'):.1f}" == m.group(1)
    assert f"{_row(without, 'norms (fp32 RMSNorm)'):.1f}" == m.group(2)
    assert f"{_row(with_sp, 'router'):.2f}" == m.group(3)
    assert f"{_row(without, 'router'):.2f}" == m.group(4)
    assert f"{_row(with_sp, 'peak (the largest phase)'):.1f}" == m.group(5)
