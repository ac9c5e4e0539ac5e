"""The command line answers --help, and parses, without importing torch (seconds on a cold start):
each command's parser reads only torch-free modules; the commands import what they run."""

from conftest import assert_runs_in_a_fresh_process


def test_building_the_parser_imports_no_torch():
    script = ("import sys\n"
              "from moefold.cli import _build_parser\n"
              "_build_parser().parse_args(['plan', 'memory', '--device', 'h100'])\n"
              "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
              "assert not loaded, loaded[:5]\n")
    assert_runs_in_a_fresh_process(script)
