"""The documentation's code runs as written: every ```python block of each page, in order."""

import pathlib
import re

import jax
import pytest


ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


# The fast tier runs the energies page (seconds); the README loads a real checkpoint, which
# tests/test_gguf.py checks in its own fast cases.
@pytest.mark.fast(page=ROOT / "docs" / "energies.md")
@pytest.mark.parametrize("page", [p for p in PAGES if BLOCK.search(p.read_text())], ids=str)
def test_page_examples_run(page):
    namespace: dict = {}
    # Users run with JAX's default (standard) dtype promotion.
    with jax.numpy_dtype_promotion("standard"):
        for i, match in enumerate(BLOCK.finditer(page.read_text())):
            code = compile(match.group(1), f"{page.name}[block {i}]", "exec")
            exec(code, namespace)  # noqa: S102
