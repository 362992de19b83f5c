"""Names kept where users found them after they moved: each warns once per use."""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from typing import Any


def moved(package: str, homes: dict[str, types.ModuleType]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package` that serves each name of `homes` from the module
    it moved to, with a `DeprecationWarning` naming the new place."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        warnings.warn(
            f"{package}.{name} is deprecated: use {home.__name__}.{name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(home, name)

    return __getattr__
