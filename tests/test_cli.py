"""The `treeattn` command line: verify, launch, bench, help."""

import itertools
import subprocess
import sys

import pytest

from treeattn import _verify


def treeattn(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "treeattn", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_verify_passes_and_reports_every_path():
    done = treeattn("verify", "--devices", "4", "--kv-seq", "256")
    assert done.returncode == 0, done.stdout + done.stderr
    for path in (
        "energy: jax.grad",
        "flash_attention[xla]",
        "tree_decode[allreduce], 4 devices",
        "tree_decode[hierarchical], 2x2",
        "ring_decode (baseline)",
        "all paths agree",
    ):
        assert path in done.stdout


def test_verify_fails_on_disagreement(capsys, monkeypatch):
    # A tolerance nothing meets, on the energy path alone (each path compiles; one is enough):
    # the row is reported as a disagreement and the status is 1.
    every_path = _verify.paths
    monkeypatch.setattr(_verify, "paths", lambda *a: itertools.islice(every_path(*a), 1))
    assert _verify.run(kv_seq=256, tolerance=0.0) == 1
    out = capsys.readouterr().out
    assert "energy: jax.grad" in out and "NO" in out and "DISAGREE" in out


def test_launch_forwards_output_and_the_failing_status():
    code = "import os, sys; print('rank', os.environ['TREEATTN_PROCESS_ID']); sys.exit(3)"
    done = treeattn("launch", "-n", "2", "--", sys.executable, "-c", code)
    assert done.returncode == 3
    assert "[0] rank 0" in done.stdout and "[1] rank 1" in done.stdout
    assert "exited with status 3" in done.stdout


@pytest.mark.parametrize("args", [["--help"], ["launch", "--help"], ["bench", "--help"]])
def test_help(args):
    done = treeattn(*args)
    assert done.returncode == 0 and "usage: treeattn" in done.stdout


def test_launch_without_a_command_is_a_usage_error():
    done = treeattn("launch", "-n", "2")
    assert done.returncode == 2 and "no command given" in done.stderr
