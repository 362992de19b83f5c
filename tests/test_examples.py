"""The research example runs at a reduced size and its tokens descend the energy."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest


ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("energy", ["softmax", "sigmoid", "stick-breaking"])
def test_energy_transformer_descends_its_energy(energy, tmp_path):
    plot, out = tmp_path / "energy.png", tmp_path / "energy.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "energy_transformer.py"),
            *("--energy", energy, "--steps", "15", "--seq-len", "16", "--dim", "16"),
            *("--heads", "2", "--memories", "16", "--plot", str(plot), "--json", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    energies = np.asarray(json.loads(out.read_text())["E"])
    assert energies.shape == (16,) and np.all(np.isfinite(energies))
    # gradient descent with a small step: E falls at every step, and by a clear margin overall
    assert np.all(np.diff(energies) <= 1e-5 * np.abs(energies[:-1])), energies
    assert energies[-1] < energies[0] - 0.05 * abs(energies[0]), energies
    assert plot.stat().st_size > 1000
