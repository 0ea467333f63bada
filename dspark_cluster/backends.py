"""The backend registry: a backend's name -> the module that implements it outside the core.

The Ray side (`actors/`) imports the core and is never imported by it; `backend("ray")` finds it by
module name on first use, as vLLM resolves an executor class by its qualified name. The module
provides the backend's executor, drafter group and remote engine client.
"""

from __future__ import annotations

import importlib

BACKENDS = {"ray": "actors.backend"}


def backend(name: str):
    """The module of the backend `name` (`ray`: actors.backend)."""
    try:
        return importlib.import_module(BACKENDS[name])
    except KeyError:
        raise ValueError(f"no backend named {name!r}; known: {', '.join(BACKENDS)}") from None
