"""Worker recovery: a target worker (or its node) was lost. The workers are torn down and started
again under the same placement rules, and every request in flight is queued for recompute from the
tokens it already has (prompt + output so far), so clients see a pause and greedy outputs do not
change. Bounded by `parallel.max_restarts`; the engine's `restarting` flag is up meanwhile (for
/health)."""

from __future__ import annotations

import logging
import time

from .errors import EngineError, WorkerError
from .executor import make_executor
from .kv_cache import BlockManager

log = logging.getLogger(__name__)


def restart_workers(engine, error: WorkerError) -> None:
    """New workers for `engine` (an LLMEngine) after `error`; raises EngineError once the restarts
    allowed are spent. The schedulers keep their requests (re-queued on a fresh KV pool), the
    balancer goes back to the default placement, the cost meter re-reads the devices."""
    limit = engine.cfg.parallel.max_restarts
    engine.restarting = True
    try:
        while True:
            if engine.num_restarts >= limit:
                raise EngineError(f"the engine stopped: a worker failed and the {limit} restart(s) allowed "
                                  "(parallel.max_restarts) are spent") from error
            engine.num_restarts += 1
            cause = error.__cause__ or error
            log.error("target worker lost (%s: %s); restart %d of %d", type(cause).__name__, cause,
                      engine.num_restarts, limit)
            t0 = time.perf_counter()
            engine.executor.shutdown()
            t1 = time.perf_counter()
            try:
                engine.executor = make_executor(engine.cfg, engine.spec)
                engine.last_restart = {"at_step": engine.num_steps, "teardown_s": t1 - t0,
                                       "start_s": time.perf_counter() - t1}
                log.warning("workers restarted: teardown %.2f s, new workers ready %.2f s",
                            t1 - t0, engine.last_restart["start_s"])
                break
            except Exception as e:  # noqa: BLE001 -- e.g. the lost node's devices are not back yet
                log.error("restart %d failed: %s: %s", engine.num_restarts, type(e).__name__, e)
                error = e if isinstance(e, WorkerError) else WorkerError(str(e))
                time.sleep(min(2.0 ** engine.num_restarts, 30.0))
        engine.num_blocks = engine.executor.num_blocks
        engine.inputs.kv_capacity = engine.num_blocks * engine.block_size
        engine.meter.reports = None  # new workers: their memory is read again
        for g in engine.schedulers:
            g.requeue_all(BlockManager(engine.num_blocks, engine.block_size, engine.cfg.scheduler.prefix_caching))
        if engine.balancer is not None:  # new workers start from the default expert placement
            engine.balancer.reset_placement()
        if engine.speculation is not None:  # they keep no context rows (and hold no drafter on the target)
            engine.speculation.workers_restarted()
    finally:
        engine.restarting = False
