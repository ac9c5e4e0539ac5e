"""What the command line does when its standard output goes away."""

import subprocess
import sys


def test_a_closed_stdout_pipe_ends_quietly_as_a_unix_tool_does():
    """`moefold config show | head -1`: the reader leaves before the command writes. It ended in a
    BrokenPipeError traceback (exit 1) and 'Exception ignored' at the interpreter's exit; it now
    stops with nothing on stderr and 128 + SIGPIPE, as a tool the signal kills."""
    proc = subprocess.Popen([sys.executable, "-m", "moefold", "config", "show", "--config", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # long before the interpreter has started and written anything
    _, stderr = proc.communicate(timeout=120)
    assert (proc.returncode, stderr.decode()) == (141, "")
