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


@pytest.mark.slow
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


def test_launch_of_a_subcommand_without_treeattn_suggests_it():
    done = treeattn("launch", "-n", "2", "--", "verify")
    assert done.returncode == 2
    assert "command 'verify' not found" in done.stderr
    assert "treeattn launch -n 2 -- treeattn verify" in done.stderr
    assert "Traceback" not in done.stderr


def test_launch_of_an_unknown_program_is_a_usage_error():
    done = treeattn("launch", "-n", "2", "--", "treeattn-no-such-program")
    assert done.returncode == 2
    assert "command 'treeattn-no-such-program' not found" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "option, value",
    [
        ("--devices", "0"),
        ("--devices", "-2"),
        ("--kv-seq", "0"),
        ("--kv-seq", "-5"),
        ("--kv-seq", "-8"),
        ("--kv-seq", "many"),
    ],
)
def test_verify_rejects_non_positive_sizes(option, value):
    done = treeattn("verify", option, value, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"argument {option}:" in done.stderr and value in done.stderr
    assert "Traceback" not in done.stderr


def test_verify_rejects_a_cache_not_split_evenly():
    done = treeattn("verify", "--devices", "4", "--kv-seq", "6", timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--kv-seq: 6 must be a multiple of the 4 devices" in done.stderr
    assert "Traceback" not in done.stderr
