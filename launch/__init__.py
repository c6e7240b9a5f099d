"""meshfl.launch: the `meshfl` commands, and meshfl from Python (api.py).

The package is callable: `meshfl.launch(...)` is `meshfl.launch.run(...)`, which runs
a mesh as `meshfl launch` does and returns its summary.

    from meshfl import launch
    summary = launch(nodes=4, algorithm="fedc2i")
"""

from __future__ import annotations

import sys
import types
from typing import Any


def __getattr__(name: str) -> Any:
    # Loaded on first use: the command line imports this package, and must stay quick.
    if name in ("run", "run_node", "UserError"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _CallablePackage(types.ModuleType):
    """This package, callable as its `run` (Python's documented way to give a module
    behaviour: setting its __class__ to a ModuleType subclass)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        from .api import run

        return run(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
