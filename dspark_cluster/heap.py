"""Python's garbage collector off the step's path.

A full (generation-2) collection walks every object the interpreter tracks: after start-up that is the
model's modules, transformers' and the tokenizer's objects, ~340k of them in an engine of the bundled
model, and one such collection took 172 ms inside a decode step of ~5 ms (BENCHMARKS.md, issue 27). They
come whenever enough long-lived objects have accumulated, so on a server they recur. `gc.freeze()` moves
everything alive at the end of start-up to a permanent generation that collections skip (as vLLM does
after its start-up), so a collection scans only what was allocated since.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_heap() -> int:
    """Collect once, then freeze what is left. Returns the objects frozen (this and earlier calls)."""
    t = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("heap frozen: %d objects (%.0f ms)", frozen, 1e3 * (time.perf_counter() - t))
    return frozen


def unfreeze_heap() -> None:
    """At shutdown: what was frozen can be collected again (an engine that stops in a process that goes
    on, e.g. a script or a test session starting several: its cycles would otherwise never be freed)."""
    gc.unfreeze()
