"""Run a test script under Triton's CPU interpreter. The interpreter is chosen by TRITON_INTERPRET
when Triton is imported, so each script runs in its own process; it must print "ok" last. Where
Triton is not installed (CI's CPU torch) the tests skip; tests/gpu/ runs the kernels compiled.
Triton 3.6's interpreter needs numpy < 2.4 (it turns 1-element arrays into Python ints, which
numpy 2.4 refuses)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package")


def run_interpreted(script: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
