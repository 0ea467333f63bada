"""`executor: ray`: the target model sharded over ShardWorker actors.

`Cluster` checks the topology against the Ray cluster before starting anything, reserves one
placement group per TP group (STRICT_PACK keeps a TP group on one node), starts the workers,
has them rendezvous at rank 0's node and load their shards, and sizes the KV pool to what every
worker can hold. Each step is one round: the same StepInput goes to every worker, but for the
draft law, which only the driver ranks (TP rank 0 of each group) read: they get their group's in a
copy of their own (`rank_inputs`), in the same round.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from dspark_cluster.config import Config
from dspark_cluster.cost import device_kind
from dspark_cluster.errors import CheckpointError, ConfigError, DSparkError, WorkerError
from dspark_cluster.executor import target_device_report
from dspark_cluster.model.spec import ModelSpec
from dspark_cluster.step import StepInput, from_wire, to_wire
from dspark_cluster.worker import WorkerConfig

from .calls import ray_get, remote_error
from .placement_groups import placement_group_name, remove_placement_groups_of


log = logging.getLogger(__name__)


def ensure_ray(num_workers: int = 1, address: str = "auto"):
    """Connect this process to Ray, saying which one. `address` (parallel.ray_address): `auto` joins
    RAY_ADDRESS (`ray job submit`), else the instance a `ray start` left running on this machine, else
    starts a private one; `local` always starts a private one; anything else is an address to join."""
    import ray

    if ray.is_initialized():
        return ray
    from ray._private.services import find_bootstrap_address, find_gcs_addresses

    join = ray_address_to_join(address, os.environ.get("RAY_ADDRESS"),
                               lambda: find_bootstrap_address(None), find_gcs_addresses)
    if join is not None:
        _say(f"joining the Ray cluster at {join}")
        try:
            ray.init(address=join, log_to_driver=False)
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise ConfigError(
                f"parallel.ray_address: could not join the Ray cluster at {join!r} ({type(e).__name__}: {e}); "
                "check that it runs (`ray status`), or set parallel.ray_address=local for a private instance"
            ) from None
        return ray
    # a private instance: CPU workers are 1-thread processes, so allow more of them than cores
    num_cpus = max(os.cpu_count() or 1, num_workers + 2)
    _say(f"starting a private Ray instance for this process ({num_cpus} CPUs); "
         "`ray start --head` first, or set RAY_ADDRESS, to use a shared one")
    # Ray runs its workers at nice 15, below the driver: here the workers are the job (the Router and
    # the shard workers), and on shared cores a nice-15 rank got ~1/4 of a core against the driver's
    # polling (BENCHMARKS.md "Topology simulator"). RAY_worker_niceness set by the user wins.
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(address="local", num_cpus=num_cpus, log_to_driver=False)
    return ray


def ray_address_to_join(address: str, env_address, last_started, running_gcs) -> "str | None":
    """The Ray cluster to join, or None to start a private one. `env_address`: RAY_ADDRESS;
    `last_started()`: the address the last `ray start` on this machine wrote (or None);
    `running_gcs()`: addresses of the GCS processes running here."""
    if address == "local":
        return None
    if address != "auto":
        return address
    if env_address:
        return env_address
    last = last_started()
    return last if last and last in running_gcs() else None


def _say(message: str) -> None:
    print(f"dspark: {message}", file=sys.stderr, flush=True)


def check_resources(cfg: Config, ray) -> str:
    """Refuse a topology the cluster cannot host. Returns the device kind ("cuda" or "cpu")."""
    world, tp = cfg.parallel.world_size, cfg.parallel.tensor
    total = ray.cluster_resources()
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    device = cfg.parallel.device
    if device == "auto":
        device = "cuda" if total.get("GPU", 0) >= world else "cpu"
    key = "GPU" if device == "cuda" else "CPU"
    have = int(total.get(key, 0))
    if have < world:
        raise ConfigError(
            f"parallel: tensor x data = {world} workers, but the Ray cluster has {have} {key} devices; "
            "lower parallel.tensor / parallel.data or add nodes"
        )
    if max((int(n.get(key, 0)) for n in nodes), default=0) < tp:
        raise ConfigError(
            f"parallel.tensor: got {tp}; no node has {tp} {key} devices to keep a TP group on one node"
        )
    if cfg.speculative.enabled and not cfg.speculative.on_target:  # the drafter group too, before any actor starts
        from .drafter_group import check_drafter_resources

        check_drafter_resources(cfg, ray)
    return device


def resolve_on_cluster(cfg: Config, ray) -> Config:
    """`cfg` with speculative.draft_passes `auto` resolved for the devices the drafting runs on in this Ray
    cluster (the target's workers for a drafter on the target, the drafter group's otherwise), not for the
    process resolving it: a Router on a head node without a GPU serves GPU workers, whose drafters take the
    second pass (BENCHMARKS.md "A second block pass"). Everything that reads draft_passes (the planner, the
    workers, the drafter actors, the calibrator) reads it from the config this returns."""
    from dspark_cluster.speculative.dspark_model import DSparkConfig, resolve_draft_passes

    sp = cfg.speculative
    if not (sp.enabled and sp.method == "dspark" and sp.draft_passes == "auto"):
        return cfg
    if sp.on_target:
        device = check_resources(cfg, ray)
    else:
        from .drafter_group import check_drafter_resources

        device = check_drafter_resources(cfg, ray)
    c = DSparkConfig.load(Path(sp.draft_model) / "config.json")
    out = cfg.model_copy(deep=True)
    out.speculative.draft_passes = resolve_draft_passes("auto", c, sp.draft_model, device)
    return out


def num_actors(cfg: Config) -> int:
    """Devices this config's actors take: the target's world, plus the drafter group's (none when the
    drafter runs on the target's driver ranks)."""
    group = cfg.speculative.enabled and not cfg.speculative.on_target
    return cfg.parallel.world_size + (cfg.speculative.draft_workers if group else 0)


def input_slots(world: int, tp: int) -> list[int]:
    """Per rank, which of a round's inputs it reads (`rank_inputs`): with tensor parallelism, 0 for
    the non-driver ranks and 1 + g for group g's driver rank (TP rank 0); without, g."""
    first = 1 if tp > 1 else 0
    return [first + r // tp if r % tp == 0 else 0 for r in range(world)]


def rank_inputs(step, tp: int, data: int) -> list:
    """One round's inputs, in the order of `input_slots`: the non-driver ranks' without any draft law
    (they do not verify), and each driver rank's with its own group's law only. `step`: a StepInput
    or one per data-parallel group. A round without a law has the same input in every slot."""
    steps = step if isinstance(step, list) else [step]
    n = data + (1 if tp > 1 else 0)
    if all(s.draft_probs is None for s in steps):
        return [step] * n
    bare = [s if s.draft_probs is None else dataclasses.replace(s, draft_probs=None, draft_law_rows=None)
            for s in steps]
    if isinstance(step, list):
        drivers = [[s if i == g else b for i, (s, b) in enumerate(zip(steps, bare))] for g in range(data)]
    else:  # every group takes the same input
        drivers = [step] * data
    return ([bare if isinstance(step, list) else bare[0]] if tp > 1 else []) + drivers


def compiled_graph_wanted(setting: str, worker_nodes: set, here: str) -> bool:
    """Whether the step goes through a Ray compiled graph: `setting` (parallel.compiled_graph) on or
    off, or for auto, only when every worker runs on this process's node `here` (see the config)."""
    if setting != "auto":
        return setting == "on"
    return worker_nodes == {here}


class Cluster:
    def __init__(self, cfg: Config, spec: ModelSpec):
        ray = ensure_ray(num_actors(cfg), cfg.parallel.ray_address)
        from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from .shard_worker import ShardWorker

        self.cfg, self.spec, self._ray = cfg, spec, ray
        self._remove_pg = remove_placement_group
        world, tp = cfg.parallel.world_size, cfg.parallel.tensor
        device = check_resources(cfg, ray)
        self.device = device
        bundle = {"GPU": 1, "CPU": 1} if device == "cuda" else {"CPU": 1}
        self.placement_groups, self.workers = [], []
        # for wait(): rounds submitted and not read, recent forward seconds by step size, last read
        self._in_flight, self._forward_s, self._last_output_at = 0, {}, 0.0
        self._unread = []  # rounds submitted whose outputs were not read (drained before a teardown)
        self.compiled = False
        self.last_wire_s = 0.0
        self.slots = input_slots(world, tp)  # per rank, which of a round's inputs it reads
        self.last_input_bytes = [0] * world  # per rank, the bytes of the last round's input
        threads = cfg.parallel.threads_per_worker or 1
        here = ray.get_runtime_context().get_node_id()
        try:
            for g in range(cfg.parallel.data):
                # group 0 on this process's node where it fits: its rounds then need no cross-node channel
                pg = placement_group([dict(bundle)] * tp, strategy="STRICT_PACK", name=placement_group_name("target"),
                                     _soft_target_node_id=here if g == 0 else None)
                self.placement_groups.append(pg)
            ready, _ = ray.wait([pg.ready() for pg in self.placement_groups], num_returns=len(self.placement_groups),
                                timeout=120)
            if len(ready) < len(self.placement_groups):  # say what the nodes had, not a bare timeout
                free = {n["NodeID"][:8]: {k: v for k, v in n.get("Resources", {}).items() if k in ("CPU", "GPU")}
                        for n in ray.nodes() if n.get("Alive")}
                raise WorkerError(
                    f"parallel: {len(self.placement_groups) - len(ready)} of {len(self.placement_groups)} tensor-parallel "
                    f"group(s) of {tp} {device} worker(s) could not be placed on one node within 120 s (node totals "
                    f"{free}; available now {ray.available_resources()}); other jobs may hold the devices")
            actor_cls = ray.remote(ShardWorker)
            worker_cfg = WorkerConfig.of(cfg)  # what a worker needs of the config, validated here once
            for rank in range(world):
                pg = self.placement_groups[rank // tp]
                self.workers.append(
                    actor_cls.options(
                        num_cpus=1,
                        num_gpus=1 if device == "cuda" else 0,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=pg, placement_group_bundle_index=rank % tp
                        ),
                    ).remote(worker_cfg, spec, rank, world, threads)
                )
            addr, port = ray.get(self.workers[0].open_rendezvous.remote())
            self.reports = self._get([w.setup.remote(addr, port, device) for w in self.workers])
            # CPU workers of one host share its memory: a share of it is split between them
            per_node = Counter(r["node_id"] for r in self.reports)
            sharing = [per_node[r["node_id"]] if device != "cuda" else 1 for r in self.reports]
            fits = self._get([w.kv_blocks_that_fit.remote(n) for w, n in zip(self.workers, sharing)])
            self.num_blocks = min(fits)
            self.kv_bytes_per_block = self._get([w.allocate_kv.remote(self.num_blocks) for w in self.workers])
            nodes = {n for pg in self.placement_groups
                     for n in placement_group_table(pg)["bundles_to_node_id"].values()}
            self.compiled = compiled_graph_wanted(cfg.parallel.compiled_graph, nodes, here)
            if self.compiled:
                self._compile()
            self.transport = "compiled_graph" if self.compiled else "actor_calls"
        except BaseException:
            self.shutdown()
            raise

    def _get(self, refs, timeout=None):
        """ray.get that surfaces a worker's own exception (CheckpointError, ...) unwrapped."""
        return ray_get(refs, timeout, failed=lambda e: CheckpointError(f"a shard worker failed: {e}"),
                       lost=lambda e: DSparkError(f"a shard worker died: {e}"))

    def _read(self, ref):
        """A round's outputs. A worker's own exception (raised while running this step's input)
        is raised as itself: the engine fails that step's requests and goes on. A lost worker (dead
        actor or node, closed channel, a round past parallel.step_timeout_s) raises WorkerError:
        the engine restarts the workers."""
        from ray.exceptions import GetTimeoutError

        timeout = self.cfg.parallel.step_timeout_s
        try:
            out = self._ray.get(ref, timeout=timeout)
            self._unread.remove(ref)
            return out
        except GetTimeoutError as e:
            raise WorkerError(f"a step took longer than parallel.step_timeout_s ({timeout:g} s)") from e
        except Exception as e:  # noqa: BLE001 -- the step's own error; or a dead actor, closed channel, lost node
            self._unread.remove(ref)
            cause = remote_error(e)
            if cause is not None and self._all_answered(ref) and self._all_alive():
                raise cause from None
            raise WorkerError("a target worker was lost during a step") from e

    def _all_answered(self, ref, grace_s: float = 2.0) -> bool:
        """Whether every rank answered (returned, or raised its own error) a round one rank failed.
        A step's own error is raised by every rank at once (SPMD) or by one while the others return;
        a rank that does not answer is gone, or wedged in a collective with one that is. A whole host
        lost is told apart only so: its peers' collectives fail at once (connection reset) while the
        GCS still has the host's workers ALIVE until its health checks of the host's raylet run out
        (seconds to tens of seconds)."""
        if self.compiled:  # a compiled graph's round (one node only; its refs are not ray.wait's): the GCS's word alone
            return True
        _, pending = self._ray.wait(ref, num_returns=len(ref), timeout=grace_s)
        if pending:
            return False
        for r in ref:
            try:
                self._ray.get(r, timeout=0)
            except Exception as e:  # noqa: BLE001 -- Ray's own failure (actor died, unavailable): not an answer
                if remote_error(e) is None:
                    return False
        return True

    def _wait_dead(self, timeout_s: float) -> None:
        from ray._private.state import state as gcs

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if all(gcs.actor_table(w._actor_id.hex()).get("State") == "DEAD" for w in self.workers):
                    return
            except Exception:  # noqa: BLE001 -- cannot tell: go on with the teardown
                return
            time.sleep(0.05)

    def _all_alive(self, grace_s: float = 2.0) -> bool:
        """Whether every worker is alive by the GCS's record. A rank that fails because a peer died
        (its collective broke) raises before the GCS has marked the peer dead: wait a little."""
        from ray._private.state import state as gcs

        deadline = time.monotonic() + grace_s
        while True:
            try:
                alive = all(gcs.actor_table(w._actor_id.hex()).get("State") == "ALIVE" for w in self.workers)
            except Exception:  # noqa: BLE001 -- cannot tell: treat as lost (a restart is safe)
                return False
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.2)

    def _compile(self):
        """A Ray compiled graph over the workers' `step`: one StepInput in, every rank's output
        back, through shared-memory channels instead of a task submission per worker."""
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as step_input:
            # one channel per input: a driver rank's (with the draft law) is read by it alone
            args = [step_input] if max(self.slots) == 0 else [step_input[i] for i in range(max(self.slots) + 1)]
            dag = MultiOutputNode([w.step.bind(args[slot]) for w, slot in zip(self.workers, self.slots)])
        self._dag = dag.experimental_compile()

    def _execute(self, inputs: list):
        """One round's output refs: through the compiled graph, or one actor call per worker (Ray
        runs one caller's calls to an actor in order, so two rounds in flight stay ordered).
        inputs: the round's pickled inputs, in the order of `input_slots`."""
        if self.compiled:
            return self._dag.execute(*inputs)
        return [w.step.remote(inputs[slot]) for w, slot in zip(self.workers, self.slots)]

    def submit(self, step):
        """Start one round to every worker. `step`: a StepInput, or one per data-parallel group
        (each worker takes its group's). Rounds run in submission order; two can be in flight
        (async scheduling). Returns a handle for `wait`."""
        t0 = time.perf_counter()
        pickled, inputs = {}, []  # a round without a draft law pickles its one input once
        for x in rank_inputs(step, self.cfg.parallel.tensor, self.cfg.parallel.data):
            if id(x) not in pickled:
                pickled[id(x)] = to_wire(x)
            inputs.append(pickled[id(x)])
        self.last_input_bytes = [len(inputs[slot]) for slot in self.slots]
        try:
            ref = self._execute(inputs)
        except Exception as e:  # noqa: BLE001 -- a closed channel: a worker is gone
            raise WorkerError("a target worker was lost while a step was submitted") from e
        self._in_flight += 1
        self._unread.append(ref)
        t1 = time.perf_counter()
        num_tokens = sum(s.input_ids.numel() for s in (step if isinstance(step, list) else [step]))
        return ref, t1 - t0, t1, num_tokens, isinstance(step, list)

    def wait(self, handle):
        """The driver rank's StepOutput of a submitted round (a list, one per group)."""
        ref, pickle_s, submitted, num_tokens, is_list = handle
        # steps of one size (steady decoding) take alike times; the least of the last few, so that a
        # cold first step or a hiccup does not make this process oversleep
        recent = self._forward_s.get(num_tokens, ())
        if self.compiled and self._in_flight > 1 and len(recent) >= 2:
            expected = min(recent)
            # Ray's compiled-graph read spins, and a spinning reader slows the workers' forward when
            # cores are scarce (2-core CPU machine: 4.8 against 4.2 ms, BENCHMARKS.md). With another
            # round queued behind this one the workers do not idle while this process sleeps, so
            # sleep through most of the expected forward and read after; a late wake-up only delays
            # this process (the lag shrinks by a fifth of a step each round), never the workers.
            delay = max(self._last_output_at, submitted) + 0.8 * expected - time.perf_counter()
            if delay > 2e-4:
                time.sleep(delay)
        try:
            raw = self._read(ref)
        finally:
            self._in_flight -= 1
        t2 = self._last_output_at = time.perf_counter()
        outs = [from_wire(o) for o in raw]
        self.last_wire_s = pickle_s + (time.perf_counter() - t2)  # this process's (de)serialization
        tp = self.cfg.parallel.tensor
        drivers = [outs[g * tp] for g in range(self.cfg.parallel.data)]  # each group's TP rank 0 samples
        slot = [o.slot_load for o in outs]
        ready = [o.migration_ready for o in outs]
        for out in drivers:
            if slot[0] is not None:
                out.slot_load = torch.stack(slot)  # [world, layers, slots per rank]
            if ready[0] is not None:
                out.migration_ready = all(bool(r) for r in ready)
                out.migration_bytes = sum(o.migration_bytes for o in outs)
        forward = max(o.forward_s for o in drivers)
        if len(self._forward_s) > 1024:
            self._forward_s.clear()
        self._forward_s.setdefault(num_tokens, collections.deque(maxlen=4)).append(forward)
        return drivers if is_list else drivers[0]

    def execute(self, step):
        """One round, waited for."""
        return self.wait(self.submit(step))

    def debug_logits(self, step: StepInput) -> torch.Tensor:  # data = 1
        """Run one step and return rank 0's logits of the sampled rows (parity checks only)."""
        step.return_logits = True
        return self.execute(step).logits

    def device_reports(self) -> list[dict]:
        """One dict per worker: role, rank, kind, memory by kind (cost.cost_ledger's devices), the
        data-parallel group its KV pool serves, the bytes of one KV block there and the most expert
        staging it held. The workers' memory reports are read again (a rebalance since setup stages
        experts); the last ones read stand in for a worker that cannot answer."""
        with contextlib.suppress(DSparkError):
            self.reports = self._get([w.memory_report.remote() for w in self.workers],
                                     timeout=self.cfg.parallel.step_timeout_s)
        kind = device_kind(self.device)
        return [target_device_report(r, kind, r["rank"] // self.cfg.parallel.tensor, per_block, self.num_blocks)
                for r, per_block in zip(self.reports, self.kv_bytes_per_block)]

    def comm_stats(self) -> list[dict]:
        return self._get([w.comm_stats.remote() for w in self.workers])

    def _drain(self, timeout_s: float = 30.0) -> None:
        """Read every round still in flight before the graph is torn down. Ray 2.60's raylet aborts
        (experimental_mutable_object_provider.cc: Check failed ... Channel closed, ray#63229) when a
        cross-node channel write reaches a node whose channel was closed by a teardown: a round left
        running (a step past its timeout, an engine stopped mid-step) would take that node down."""
        deadline = time.monotonic() + timeout_s
        for ref in self._unread:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            with contextlib.suppress(Exception):  # a dead worker's round fails at once
                self._ray.get(ref, timeout=left)
        self._unread = []

    def shutdown(self) -> None:
        """Drain the rounds in flight, kill the workers and wait for them to be gone, and only then
        tear the compiled graph down: a worker still alive at the teardown can write into a channel
        the teardown has closed, and a cross-node write to a closed channel aborts the receiving
        node's raylet (ray#63229; seen in this project's 2-node test cluster)."""
        ray = self._ray
        dag, self._dag = getattr(self, "_dag", None), None
        if dag is not None:
            self._drain()
        self._unread = []  # plain actor calls: killing their workers is all they need
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                pass
        if dag is not None:
            self._wait_dead(timeout_s=30.0)
            try:
                dag.teardown()
            except Exception:
                pass
        for pg in self.placement_groups:
            try:
                self._remove_pg(pg)
            except Exception:
                pass
        self.workers, self.placement_groups = [], []
        time.sleep(0)  # actors die asynchronously; their resources return shortly


def start_router(cfg: Config):
    """Start the Router actor (it starts the shard workers) and wait until it serves."""
    ray = ensure_ray(num_actors(cfg), cfg.parallel.ray_address)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from .router import Router

    check_resources(cfg, ray)  # refuse before any actor starts
    # on the driver's node (its fate is the driver's already): an actor of no resources lands on any
    # node, and on a worker host the engine dies with that host (seen on tests/test_multihost.py's
    # cluster; a soft affinity still put 3 in 8 elsewhere there)
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    router = ray.remote(Router).options(num_cpus=0, max_concurrency=1000,
                                        scheduling_strategy=here).remote(cfg.to_dict())
    try:
        ray_get(router.start.remote())
    except BaseException:
        ray.kill(router, no_restart=True)
        with contextlib.suppress(Exception):  # (the start's own error is the one to raise)
            remove_placement_groups_of(router._actor_id.hex())  # what it placed before it failed
        raise
    return router


def stop_router(router, timeout_s: float = 90.0) -> None:
    """Ask the Router to shut down (it drains, stops its workers and drafters, removes its placement
    groups), then kill it and remove whatever placement groups it left: a Router killed while it was
    still shutting down (past `timeout_s`: a slow machine, a step stuck past its timeout) would
    otherwise leave its groups holding their devices for the rest of the job."""
    import ray

    try:
        ray.get(router.shutdown.remote(), timeout=timeout_s)
    except Exception:
        pass
    ray.kill(router, no_restart=True)
    with contextlib.suppress(Exception):
        remove_placement_groups_of(router._actor_id.hex())
