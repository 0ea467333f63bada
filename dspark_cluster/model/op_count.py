"""Count what a forward issues: tensor operations (every aten op dispatched, views included, as
a GPU would see kernel launches and their Python overhead) and host synchronisations (a value read
back to Python: `.item()` / `int(t)` / `bool(t)`, `.tolist()`, `.numpy()`, a copy to the CPU from
another device). On a GPU each synchronisation waits for the stream to drain, so a forward should
have a fixed few, none inside a layer.

    with count_ops() as c:
        model(...)
    c.ops            Counter of aten op names
    c.syncs          Counter of synchronisation kinds
    c.sync_sites     Counter of "file:line" where each happened (the innermost frame in this project)

A CPU tensor's `.tolist()` does not go through the dispatcher, so the methods that read values back
are wrapped for the duration of the block; `.item()`, `int(t)`, `float(t)` dispatch `aten.item`
(`aten._local_scalar_dense` below it) and `bool(t)` `aten.is_nonzero`, counted there.
"""

from __future__ import annotations

import collections
import contextlib
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_PROJECT = str(Path(__file__).resolve().parent.parent.parent)


def _site() -> str:
    """The innermost caller inside this project (not torch, not this file)."""
    f = sys._getframe(2)
    here = str(Path(__file__).resolve())
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(_PROJECT) and name != here:
            return f"{Path(name).relative_to(_PROJECT)}:{f.f_lineno}"
        f = f.f_back
    return "?"


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.syncs = collections.Counter()
        self.sync_sites = collections.Counter()

    def sync(self, kind: str) -> None:
        self.syncs[kind] += 1
        self.sync_sites[_site()] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket.__name__)
        self.ops[name] += 1
        if name in ("item", "_local_scalar_dense", "is_nonzero"):  # .item(), int(t), float(t); bool(t)
            self.sync("item")
        elif name in ("_to_copy", "copy_") and args:
            src = args[1] if name == "copy_" else args[0]
            dst = (args[0].device if name == "copy_" else kwargs.get("device"))
            if isinstance(src, torch.Tensor) and dst is not None and torch.device(dst).type == "cpu" \
                    and src.device.type != "cpu":
                self.sync("to_cpu")
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_ops():
    counter = _Counter()
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def wrap(name, fn):
        def wrapper(self, *a, **kw):
            counter.sync(name)
            return fn(self, *a, **kw)
        return wrapper

    for name, fn in originals.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        with counter:
            yield counter
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
