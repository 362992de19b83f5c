"""The research examples run at a reduced size: the Energy Transformer's tokens descend its
energy, and the attention maps of SmolLM2 are written and sane."""

import importlib.util
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


def test_attention_maps_of_smollm2(tmp_path):
    """The attention-maps example on 32 tokens and 2 layers of SmolLM2: its plots are written,
    every entropy lies in [0, log(#keys seen)], and each head's received attention adds up to
    the number of queries. And what the full run shows holds at this size: layer 0 attends
    broadly, and layer 18's heads 7 and 8 attend to token 0 alone (an attention sink)."""
    spec = importlib.util.spec_from_file_location(
        "attention_maps", ROOT / "examples" / "attention_maps.py"
    )
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    n = 32
    result = example.main(["--tokens", str(n), "--layers", "0", "18", "--out", str(tmp_path)])
    for file in result["files"]:
        assert file.parent == tmp_path and file.stat().st_size > 1000
    entropy, received = result["entropy"], result["received"]  # [layers, seq, heads]
    assert entropy.shape == received.shape == (2, n, 9)
    bound = np.log(np.arange(1, n + 1))[None, :, None]
    assert np.all(entropy >= -1e-5) and np.all(entropy <= bound + 1e-4)
    np.testing.assert_allclose(entropy[:, 0], 0, atol=1e-6)  # query 0 sees one key
    assert np.all(received >= 0)
    np.testing.assert_allclose(received.sum(axis=1), n, rtol=1e-5)
    assert 0 <= result["token0_share"].min() and result["token0_share"].max() <= 1 + 1e-6
    assert np.all(result["entropy_frac"][0] > 0.5)  # measured 0.68 to 0.90
    assert np.all(received[1, 0, 7:] > 0.99 * n)  # measured 0.9999 and 1.0 of n
