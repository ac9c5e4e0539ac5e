"""`moefold train --nproc N` as a user runs it: N gloo ranks, one voice (rank 0 prints and writes
metrics), every rank's checkpoint shard, the same training as one process; layout errors that
stop the job before anything is written; a rank killed, the others stopped; the launcher's
signals passed on; and how a rank's process ends."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import run_cli, run_cli_interrupted

from moefold.errors import RANK_REPORTS_ENV, report
from moefold.parallel import launch
from moefold.parallel.launch import run_local_ranks, say_rank_reports


def _metrics(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


# (layout, per-rank micro-batch): 2 data ranks × 2 sequences, or tp 2 with sequence parallelism
# (each rank routes its half of every sequence and the statistics add up over the two) × 4.
LAUNCHED_LAYOUTS = [(["--parallel.ep", "2"], 2), (["--parallel.tp", "2", "--model.n_kv_heads", "2"], 4)]


@pytest.mark.parametrize("layout, micro_batch", LAUNCHED_LAYOUTS, ids=["ep2", "tp2-sp"])
def test_nproc_trains_like_one_process_with_one_voice(layout, micro_batch, tiny_args, tmp_path):
    model = layout[2:]  # a model option the layout needs, given to both runs
    one = run_cli(["train", *tiny_args, *model, "--run-dir", str(tmp_path / "one"), "--train.micro_batch_size", "4"])
    assert one.returncode == 0, one.stderr
    two = run_cli(["train", *tiny_args, "--nproc", "2", *layout, "--run-dir", str(tmp_path / "two"),
                   "--train.micro_batch_size", str(micro_batch)])  # the same global batch
    assert two.returncode == 0, two.stderr
    assert two.stdout.count("run dir:") == 1  # only rank 0 speaks
    steps = [r["step"] for r in _metrics(tmp_path / "two") if "loss" in r]
    assert steps == list(range(1, 13))  # written once per step, by one rank
    losses_one = [r["loss"] for r in _metrics(tmp_path / "one") if "loss" in r]
    losses_two = [r["loss"] for r in _metrics(tmp_path / "two") if "loss" in r]
    assert max(abs(a - b) / a for a, b in zip(losses_one, losses_two)) < 1e-4
    for key in ("aux_loss", "load_imbalance", "routing_entropy"):  # the global batch's statistics
        one_values = [r[key] for r in _metrics(tmp_path / "one") if key in r]
        two_values = [r[key] for r in _metrics(tmp_path / "two") if key in r]
        assert len(one_values) == len(two_values) == 12, key
        assert max(abs(a - b) / abs(a) for a, b in zip(one_values, two_values)) < 1e-4, key
    checkpoint = next((tmp_path / "two" / "checkpoints").iterdir())
    assert sorted(p.name for p in checkpoint.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


def test_layout_that_does_not_fit_the_ranks_stops_before_writing(tiny_args, tmp_path):
    run_dir = tmp_path / "r"
    result = run_cli(["train", *tiny_args, "--run-dir", str(run_dir), "--parallel.ep", "2"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "moefold: error: parallel: world size 1 is not divisible by etp·ep·pp = 2 (etp=1, ep=2, pp=1) "
        "(one process: launch the ranks with torchrun --nproc-per-node N -m moefold train or moefold "
        "train --nproc N)"]
    result = run_cli(["train", *tiny_args, "--run-dir", str(run_dir), "--nproc", "3", "--parallel.tp", "2",
                      "--model.n_kv_heads", "2"])
    assert result.returncode == 2
    assert result.stderr.strip() == ("moefold: error: parallel: world size 3 is not divisible by "
                                     "tp·cp·pp = 2 (tp=2, cp=1, pp=1)")
    assert not run_dir.exists()


def test_an_error_every_rank_meets_is_said_once(tiny_args, tmp_path):
    """Each rank checks the data path itself; the user reads the error once, not once a rank."""
    run_dir = tmp_path / "r"
    result = run_cli(["train", *tiny_args, "--run-dir", str(run_dir), "--nproc", "2", "--parallel.ep", "2",
                      "--data.path", str(tmp_path / "missing.txt")])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"moefold: error: data.path={tmp_path / 'missing.txt'}: no such file or directory"]


def test_a_diverged_job_stops_on_every_rank_at_once(tiny_args, tmp_path):
    """The gradient norm is global: every rank sees it go non-finite at the same step and stops
    there (no rank left waiting in a collective), said once."""
    result = run_cli(["train", *tiny_args, "--run-dir", str(tmp_path / "r"), "--nproc", "2", "--parallel.ep", "2",
                      "--train.lr", "1e30", "--train.weight_decay", "0", "--train.warmup_steps", "1",
                      "--logging.log_every", "3"])
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line.startswith("moefold: error: training diverged: the gradient norm was nan within steps 1–3"), line


def test_rank_reports_name_the_ranks_only_where_they_disagree(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(RANK_REPORTS_ENV, str(tmp_path))
    for rank, line in [(0, "moefold: error: shard 0 is corrupt"), (1, "moefold: interrupted"),
                       (3, "moefold: interrupted")]:
        monkeypatch.setenv("RANK", str(rank))
        report(line)
    assert capsys.readouterr().err == ""  # left for the launcher, not said by the ranks
    say_rank_reports(tmp_path, 4)
    assert capsys.readouterr().err.splitlines() == ["moefold: error: shard 0 is corrupt (rank 0)",
                                                    "moefold: interrupted (ranks 1, 3)"]
    (tmp_path / "rank0").unlink()
    say_rank_reports(tmp_path, 4)
    assert capsys.readouterr().err.splitlines() == ["moefold: interrupted"]
    monkeypatch.setenv(RANK_REPORTS_ENV, str(tmp_path / "gone"))  # the launcher's folder is gone
    report("moefold: error: said here")
    assert capsys.readouterr().err == "moefold: error: said here\n"


def test_exit_rank_flushes_and_skips_interpreter_shutdown():
    script = ("import atexit, sys\n"
              "from moefold.parallel.launch import exit_rank\n"
              "atexit.register(lambda: print('shutdown ran'))\n"
              "print('out', end='')\n"
              "sys.stderr.write('err')\n"
              "exit_rank(3)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout buffered
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, env=env)
    assert (result.returncode, result.stdout, result.stderr) == (3, "out", "err")


_RANK_0_KILLED = """
import os, signal, sys, time
if os.environ["RANK"] == "0":
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's out-of-memory killer does
if sys.argv[1] == "ignores-sigterm":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(120)
"""


@pytest.mark.parametrize("peers", ["stop-on-sigterm", "ignores-sigterm"])
def test_a_killed_rank_is_named_and_the_others_are_stopped(capsys, monkeypatch, peers):
    """A rank killed before it can say anything: the launcher names it and the signal, stops the
    other ranks (SIGKILL for those that outlast the grace period) and exits as a shell would."""
    monkeypatch.setattr(launch, "STOP_GRACE_S", 1.0)
    started = time.monotonic()
    assert run_local_ranks(3, [sys.executable, "-c", _RANK_0_KILLED, peers]) == 128 + signal.SIGKILL
    assert time.monotonic() - started < 60  # not the peers' 120 s sleep
    assert capsys.readouterr().err.splitlines() == [
        "moefold: error: rank 0 was killed by SIGKILL (the kernel's out-of-memory killer sends it: the job "
        "may need more host memory than this machine has); the other ranks were stopped"]


_FAILS_WHILE_STOPPING = """
import os, pathlib, signal, sys, time
if os.environ["RANK"] == "0":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # fails instead of saving
else:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as if waiting on rank 0 in a collective
pathlib.Path(sys.argv[1], os.environ["RANK"]).touch()
time.sleep(120)
"""

_LAUNCHER = """
import sys
from moefold.parallel import launch
launch.STOP_GRACE_S = 1.0
sys.exit(launch.run_local_ranks(2, [sys.executable, "-c", sys.argv[1], sys.argv[2]]))
"""


def test_a_rank_failing_while_the_ranks_stop_on_a_signal_stops_the_others(tmp_path):
    """After a signal is passed on, a rank ending 128 + it has saved and stopped as asked; one that
    fails otherwise leaves the rest waiting for it, so they are stopped as after any failure."""
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, _FAILS_WHILE_STOPPING, str(tmp_path)],
                                stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not all((tmp_path / r).exists() for r in "01") and time.time() < deadline:
        time.sleep(0.05)
    started = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    try:
        launcher.communicate(timeout=100)
    finally:
        launcher.kill()
    assert launcher.returncode == 1
    assert time.monotonic() - started < 60  # rank 1 SIGKILLed, not its 120 s sleep waited out


_SLEEPS = """
import os, pathlib, sys, time
pathlib.Path(sys.argv[1], str(os.getpid())).touch()
time.sleep(120)
"""


def test_a_signal_while_the_ranks_start_stops_the_start(monkeypatch):
    """Signals are passed on from the first rank's start: one that comes while the launcher is
    still starting ranks reaches those started and no further rank starts (with --nproc in the
    thousands the ranks started so far were left running after the launcher went)."""
    monkeypatch.setattr(launch, "STOP_GRACE_S", 5.0)
    started = []
    popen = subprocess.Popen

    def starting(*args, **kwargs):
        started.append(popen(*args, **kwargs))
        if len(started) == 2:
            # To the main thread, which holds it back while it starts a rank (a launcher's only
            # thread). os.kill's process-wide signal may go to another thread this test process
            # has (torch's, gloo's), whose delivery can come after the next rank started.
            signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
        return started[-1]

    monkeypatch.setattr(launch.subprocess, "Popen", starting)
    begun = time.monotonic()
    assert run_local_ranks(50, [sys.executable, "-c", "import time; time.sleep(120)"]) == 128 + signal.SIGTERM
    assert len(started) == 2 and all(proc.returncode == -signal.SIGTERM for proc in started)
    assert time.monotonic() - begun < 60


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_ranks_end_with_a_launcher_killed_by_sigkill(tmp_path):
    """The launcher cannot pass SIGKILL on (the out-of-memory killer's): each rank gets SIGTERM
    when it dies instead of sleeping on, orphaned, waiting for peers."""
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, _SLEEPS, str(tmp_path)])
    deadline = time.time() + 60
    while len(list(tmp_path.iterdir())) < 2 and time.time() < deadline:
        time.sleep(0.05)
    ranks = [int(p.name) for p in tmp_path.iterdir()]
    assert len(ranks) == 2 and all(map(_alive, ranks))
    launcher.kill()
    launcher.wait()
    deadline = time.time() + 30
    while any(map(_alive, ranks)) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(map(_alive, ranks))


def test_more_cpu_ranks_than_the_host_holds_are_refused_before_any_starts(tiny_args, tmp_path, monkeypatch, capsys):
    """Each CPU rank is an interpreter with torch loaded (launch.RANK_RUNTIME_BYTES at least): an
    --nproc whose ranks the host cannot hold is refused in one line, before any starts (a fuzzed
    --nproc 2147483648 started ranks until the machine ran out of memory)."""
    import moefold.plan.fit as fit

    from moefold.cli import main

    monkeypatch.setattr(fit, "host_memory_bytes", lambda: 1 * 2**30)
    monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: pytest.fail("a rank was started"))
    run_dir = tmp_path / "run"
    assert main(["train", *tiny_args, "--run-dir", str(run_dir), "--nproc", "5", "--train.device", "cpu"]) == 2
    assert capsys.readouterr().err == (
        "moefold: error: --nproc 5: 5 ranks need at least 1.2 GiB for their Python and torch runtimes alone "
        "(0.25 GiB each), and this host has 1.0 GiB of RAM and swap; start at most 4\n")
    assert not run_dir.exists()


def test_sigterm_to_the_launcher_reaches_every_rank(tiny_args, tmp_path):
    """`kill <launcher>` (a scheduler's time limit, `timeout`) stops the job as it stops one
    process: every rank saves its checkpoint shard and the job exits 128 + SIGTERM."""
    run_dir = tmp_path / "run"
    result = run_cli_interrupted(["train", *tiny_args, "--run-dir", str(run_dir), "--nproc", "2", "--parallel.ep", "2",
                                  "--train.steps", "3000"], run_dir)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    acknowledged, line = result.stderr.splitlines()  # rank 0's, at once; the job's, at its end
    assert acknowledged.startswith("moefold: SIGTERM received; stopping after the next step at the latest "), acknowledged
    assert line.startswith("moefold: interrupted by SIGTERM at step "), line
    checkpoint = next((run_dir / "checkpoints").iterdir())
    assert sorted(p.name for p in checkpoint.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


_SIGTERM_TO_RANK_1 = """
import os, runpy, signal
import moefold.checkpoint.dcp as checkpoint
from moefold.train.trainer import Trainer
to_rank_1 = lambda: os.environ["RANK"] == "1" and os.kill(os.getpid(), signal.SIGTERM)
train_step, save = Trainer.train_step, checkpoint.dcp.save
def in_step_6(self):
    if self.step == 5:
        to_rank_1()
    return train_step(self)
def in_the_save_of_step_4(state, checkpoint_id):
    if state["step"] == 4:
        to_rank_1()
    return save(state, checkpoint_id=checkpoint_id)
if os.environ["SIGNAL_IN"] == "step 6":
    Trainer.train_step = in_step_6
else:
    checkpoint.dcp.save = in_the_save_of_step_4
runpy.run_module("moefold", run_name="__main__")
"""


@pytest.mark.parametrize("signal_in, options, stop, logged", [
    ("step 6", [], 7, [7, 12]),
    # the resumed run's checkpoint of step 8 ends a log window: a record there too
    ("the save of step 4", ["--checkpoint.every", "4", "--checkpoint.keep", "1"], 4, [4, 8, 12])])
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tiny_args, tmp_path, signal_in, options, stop,
                                                                logged):
    """SIGTERM to rank 1 alone (a scheduler signalling one node), as torchrun runs the ranks (no
    launcher passing it on). The ranks agreed on a stop at log steps only: with logging.log_every
    past the end of the run nobody stopped before step 12, however long the grace period. They vote
    every step: both stop after the signal's step or the next (7), or with the checkpoint the
    signal arrived in the save of (4, not a second save), each with its shard of it and 128 +
    SIGTERM; the run resumes from it."""
    run = tmp_path / "run"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(launch.free_port()), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", "SIGNAL_IN": signal_in}
    command = [sys.executable, "-c", _SIGTERM_TO_RANK_1, "train", *tiny_args, "--run-dir", str(run),
               "--parallel.ep", "2", "--logging.log_every", "100", *options]
    ranks = [subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        ended = [rank.communicate(timeout=300) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    checkpoint = run / "checkpoints" / f"step_{stop:08d}"
    for rank, (_, err) in zip(ranks, ended):
        assert (rank.returncode, err.splitlines()) == (128 + signal.SIGTERM, [
            f"moefold: interrupted by SIGTERM at step {stop}; checkpoint saved to {checkpoint}"]), err
    assert [p.name for p in (run / "checkpoints").iterdir()] == [checkpoint.name]
    assert sorted(p.name for p in checkpoint.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert [r["step"] for r in _metrics(run) if "loss" in r] == [stop]  # on record before the stop
    resumed = run_cli(["train", "--resume", str(run), "--nproc", "2"])
    assert resumed.returncode == 0, resumed.stderr
    assert [r["step"] for r in _metrics(run) if "loss" in r] == logged
    assert sorted(p.name for p in (run / "checkpoints").iterdir())[-1] == "step_00000012"
