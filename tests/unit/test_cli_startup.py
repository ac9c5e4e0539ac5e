"""The command line answers --help, and parses, without importing torch (seconds on a cold start):
each command's parser reads only torch-free modules; the commands import what they run."""

import subprocess
import sys


def test_building_the_parser_imports_no_torch():
    script = ("import sys\n"
              "from moefold.cli import _build_parser\n"
              "_build_parser().parse_args(['plan', 'memory', '--device', 'h100'])\n"
              "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
              "assert not loaded, loaded[:5]\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
