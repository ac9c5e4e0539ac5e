"""Runs that are interrupted (SIGINT, SIGTERM, a kill) or fail part-way keep what they wrote whole:
checkpoints, metrics.jsonl and config.toml; signals land at chosen moments through hooks that send
them from inside the process, not through timing."""

import signal
import subprocess
import sys

_SIGINT_WHILE_BUILDING_THE_PARSER = """
import os, signal, sys
import moefold.cli as cli
add_plan_parser = cli._add_plan_parser
def interrupted(commands):  # Ctrl-C in the seconds the parser's imports (torch) take
    os.kill(os.getpid(), signal.SIGINT)
    add_plan_parser(commands)
cli._add_plan_parser = interrupted
sys.exit(cli.main(sys.argv[1:]))
"""


def test_ctrl_c_while_the_command_line_starts_is_one_line_and_130():
    result = subprocess.run([sys.executable, "-c", _SIGINT_WHILE_BUILDING_THE_PARSER, "train"],
                            capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr) == (128 + signal.SIGINT, "moefold: interrupted\n")
