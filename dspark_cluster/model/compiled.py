"""`model.compile`: steps through `torch.compile`, their token counts padded to buckets.

A step of T new tokens (decodes, verify rows, short prompt chunks, any mix) is padded to the smallest
bucket >= T (vLLM's capture sizes: 1, 2, 4, then every 8 up to 256 and every 16 past it, up to the most
tokens a step of `scheduler.max_num_seqs` sequences verifying `speculative.num_tokens` drafts takes);
longer steps (prompt chunks) run eager. The padding rows are token 0 at position 0: they write no KV,
attend nothing, take row 0's experts (`real`: kept out of the expert-load statistics) and are dropped.
Attention and the grouped expert matmul are opaque ops to the compiler (`dspark::step_attention`,
`dspark::grouped_experts`); attention reads the step's metadata from `attention.step_context`, not from
the graph's inputs (vLLM's forward context), so the graphs see a step's padded token count only:
everything between those ops (projections, norms, rope, routing, the residual stream) is one graph for
a step of one token and one for every larger bucket (the token count a dynamic dimension: compiled once,
as vLLM does, so fine buckets cost no compile time), and a drafting step's verify rows replay the same
graphs as a decode step.

On CUDA the graphs are captured as CUDA graphs (`mode="reduce-overhead"`), piecewise as vLLM's:
attention runs between the captured pieces (inductor's graph partition), because its key length grows
with the context and its layout changes with the step's composition; so do the experts unless torch's
grouped matmul keeps their offsets on the device (the fallbacks read the counts on the host). A CUDA
graph's outputs are overwritten by its next replay: what a step leaves for later (the exported layers'
states, which the context stash holds across idle steps) is copied out.

    runner = CompiledSteps(model, buckets, device, captures)
    runner.warm_up()                    compile every bucket now, for each capture (progress lines, seconds)
    runner.applies(step) -> bool        a step of 1 to buckets[-1] tokens
    runner(step, capture) -> hidden [T, H]
                                        on CUDA a thread's first step records that thread's CUDA graphs of
                                        every bucket first (inductor's graph trees are per thread)
    runner.stats() -> dict              buckets, warm-up seconds, graphs compiled, recompiles since (and CUDA
                                        graphs recorded, before the first steps and since)

Dynamo checks a graph's guards on the host before every call (~80 a layer, ~1.5 ms a step at DeepSeek-V3's 61
layers on a CPU host). A runner drops those on its modules' tensors (`module_guard_filter`), and while the module
values its graphs read that can change (`TRACED_VALUES`) are those they were checked under (none was assigned
since: `layers.traced_writes`, one read a step), and dynamo's global-state guard passes, calls the graph's code
directly (`CompiledSteps.forward`, as vLLM's dispatcher does); every other value a guard reads is fixed at load
(`FIXED_VALUES`; a value in neither keeps every step guarded, tested per architecture), as are the functions and
module constants a trace inlines (one patched after the warm-up is seen by guarded calls only).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import re
import threading
import time
import types

import torch

from . import layers
from .attention import build_metadata, step_context

log = logging.getLogger(__name__)


def step_buckets(most: int) -> list[int]:
    """The token counts steps are padded to, up to `most`: 1, 2, 4, every 8 up to 256, every 16 past it, and most
    (vLLM's capture sizes: a step pads by fewer than 8 tokens, 16 past 256, where powers of 2 padded 33 to 64)."""
    sizes = [1, 2, 4, *range(8, 257, 8), *range(272, most, 16)]
    return sorted({b for b in sizes if b < most} | {most})


# The largest bucket at most (vLLM's largest capture size by default): past it a step's launches are a small share of
# its time, and on CUDA every bucket's graphs hold memory the KV plan does not count
MAX_BUCKET_TOKENS = 512


def compile_buckets(cfg) -> list[int]:
    """The buckets of a config: up to a full batch's decode step, or its verify step where it speculates (each
    sequence its token and num_tokens drafts), within max_num_batched_tokens and MAX_BUCKET_TOKENS."""
    sc, spec = cfg.scheduler, cfg.speculative
    per_seq = 1 + (spec.num_tokens if spec.enabled else 0)
    return step_buckets(min(sc.max_num_batched_tokens, sc.max_num_seqs * per_seq, MAX_BUCKET_TOKENS))


def bucket_of(n: int, buckets: list[int]) -> int:
    """The bucket a step of n tokens is padded to (n itself past the largest, or 0: the step runs eager)."""
    return buckets[bisect.bisect_left(buckets, n)] if 0 < n <= buckets[-1] else n


def resolve_compile(setting: str, device) -> bool:
    """model.compile -> on or off, for the target's steps and the drafter's rounds alike. auto: on for CUDA (graphs
    replay a step's thousands of launches); off on a CPU: there a compiled step measured faster at batch 1 (TPOT
    0.77-0.79x eager's) and in batch-64 serving (1.04-1.06x), but the default job (32 requests at once) ran at par
    (0.98x its throughput) and took 1.7-1.8x its wall time with inductor's cache warm, 6.2x cold (BENCHMARKS.md, issue
    27, sessions 34 and 37): `on` for a long-lived CPU server at low batch. Under auto, a one-rank worker whose steps
    fail to compile at start-up runs them eager (`Worker.allocate_kv`), and so does a DSpark drafter its rounds
    (`DSparkProposer`)."""
    if setting == "auto":
        return torch.device(device).type == "cuda"
    return setting == "on"


def compiled_or_eager(make, eager_if_fails: bool, what: str):
    """make() -> a compiled runner, warmed up. (runner, None); or, where its compile fails (dynamo's or inductor's
    errors: no compiler on this host, an op it cannot lower) and eager_if_fails (model.compile auto), (None, the
    reason) with a warning: the caller runs `what` eager. Raises otherwise."""
    try:
        return make(), None
    except torch._dynamo.exc.TorchDynamoException as e:
        if not eager_if_fails:
            raise
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        log.warning("model.compile auto: %s did not compile (%s); they run eager", what, reason)
        return None, reason


def _counter(group: str, name: str) -> int:
    """One of dynamo's / inductor's process-wide counters."""
    from torch._dynamo.utils import counters

    return int(counters[group][name])


def _graphs() -> int:
    return _counter("stats", "unique_graphs")


def _cuda_graph_manager(device: torch.device):
    """Inductor's CUDA graph tree manager for `device` in this thread (None off CUDA, before any graph, or where
    this torch keeps it elsewhere). Managers are per thread: a graph is recorded under the manager of the thread
    that first runs it at its size."""
    if device.type != "cuda":
        return None
    try:
        from torch._inductor import cudagraph_trees

        index = device.index if device.index is not None else torch.cuda.current_device()
        return cudagraph_trees.get_manager(index, create_if_none_exists=False)
    except (ImportError, AttributeError, TypeError):
        return None


def functions_mark(device: torch.device) -> int:
    """How many compiled functions this thread's CUDA graph tree manager holds (0 off CUDA, before any graph): what
    `note_functions` reads past (a manager only adds functions, in order; one len a call, not a set)."""
    manager = _cuda_graph_manager(device)  # (None off CUDA, at once)
    return len(getattr(manager, "ids_to_funcs", None) or ()) if manager is not None else 0


def note_functions(functions: dict, device: torch.device, mark: int) -> None:
    """After a runner's graphs ran on this thread (its warm-up, its recording pass, or a call: calls on a thread are
    sequential): the functions they registered with the thread's tree manager past `mark` (`functions_mark` before
    they ran; each size of a graph recorded is one, and so is a recompiled graph's) are the runner's (functions:
    thread id -> ids). The target's steps and a drafter's rounds share each thread's manager: each counts its own
    graphs. Nothing off CUDA."""
    if device.type != "cuda":
        return
    ids = getattr(_cuda_graph_manager(device), "ids_to_funcs", None) or {}
    if len(ids) > mark:
        tid = threading.get_ident()
        functions[tid] = functions.get(tid, set()) | set(itertools.islice(ids, mark, None))


def _cuda_graphs(managers: dict, functions: dict) -> int:
    """CUDA graphs recorded in these threads' tree managers (thread id -> manager) by the functions noted for each
    thread (`note_functions`): the nodes of their trees that run one of those."""
    n = 0
    for tid, manager in managers.items():
        mine = functions.get(tid, set())
        try:
            nodes = list(manager.get_roots())
        except (AttributeError, TypeError):
            continue
        while nodes:
            node = nodes.pop()
            n += getattr(getattr(node, "wrapped_function", None), "id", None) in mine
            nodes.extend(c for children in node.children.values() for c in children)
    return n


def allow_cuda_graph_sizes(n: int) -> None:
    """Inductor warns when one graph records CUDA graphs of more than `cudagraph_dynamic_shape_warn_limit` sizes
    (8): a runner's buckets are that by design. The limit is read from the process-wide config when a graph records
    (a compile's options do not reach it there): raised to n there, never lowered (None: the warning off, kept)."""
    triton = torch._inductor.config.triton
    limit = getattr(triton, "cudagraph_dynamic_shape_warn_limit", None)
    if limit is not None and limit < n:
        triton.cudagraph_dynamic_shape_warn_limit = n


def experts_in_cuda_graphs(w13: torch.Tensor, w2: torch.Tensor, capability: tuple) -> bool:
    """Whether the expert op may run inside a CUDA graph on a device of this compute capability: only where torch's
    grouped matmul keeps its offsets on the device, bf16 on sm90 / sm100 (elsewhere torch's own fallback reads them
    on the host, as ours does slot by slot, and a capture forbids that)."""
    return w13.dtype == torch.bfloat16 and capability[0] in (9, 10) and layers.grouped_mm_available(w13, w2)


# Guards dynamo puts on a runner's own modules that its life cannot fail: their tensors' metadata (parameters, buffers
# and the KV cache keep shape, dtype, device and strides: loads, version switches and expert migrations copy in place,
# and the runner is made after the KV pool), whether two of them alias, and the module system's bookkeeping (no hooks,
# no attribute shadowed). Every Python value the trace reads (a flag, a head count, the expert ids' length, the
# dispatcher) keeps its guard and recompiles when it changes. At DeepSeek-V3's 61 layers the full set is ~13k guards,
# checked before every step on the host: ~0.45 ms on this CPU, half of it these (BENCHMARKS.md, session 31).
_STATIC_MODULE_GUARDS = frozenset({"TENSOR_MATCH", "DUPLICATE_INPUT", "EMPTY_NN_MODULE_HOOKS_DICT",
                                   "NOT_PRESENT_IN_GENERIC_DICT", "DICT_NOT_CONTAINS"})


# The module values the steps' graphs read (the kept guards on the runner's modules, `guarded_values`: (attribute,
# guard kind)) that can change while a runner serves, each with the guard kinds the key covers: the modules holding them
# mark every assignment (`layers.Traced` attributes; the attention layers' `kv_cache` property); a step after none
# calls the graphs without dynamo's guards (`CompiledSteps.forward`); after one it takes the guarded call, which
# recompiles where the graphs read the value
TRACED_VALUES = frozenset({("study", "CONSTANT_MATCH"), ("identity_slots", "CONSTANT_MATCH"),
                           ("dispatch", "CONSTANT_MATCH"), ("dispatch", "ID_MATCH"),
                           ("expert_ids", "SEQUENCE_LENGTH"), ("_kv_cache", "SEQUENCE_LENGTH")})
# and the attributes the architecture fixes at load, whatever the guard (sizes, flags, fused projections' splits, the
# decoder's layers, the communicator's ranks and key, a vocabulary shard's start, the expert dispatcher's key and
# method, a method's defaults); module types are fixed too
FIXED_VALUES = frozenset({"bias", "down_name", "eps", "head_dim", "is_moe", "n_group", "nope", "norm_topk_prob",
                          "num_heads", "num_kv_heads", "q_lora", "qk_norm", "rank", "rope", "routed_scaling_factor",
                          "scale", "scoring", "shared_expert_gate", "shared_intermediate_size", "sizes", "top_k",
                          "topk_group", "vdim", "layers", "mlp", "tp_rank", "tp_size", "group_key", "dispatch_key",
                          "__defaults__", "__defaults__[]", "sizes[]", "fget", "__call__", "num_experts", "start"})


def guarded_value(entry) -> "tuple | None":
    """(attribute, guard kind) of a kept guard on the runner's modules ("study" of `self.model.layers[3].mlp.study`;
    an element read by index is "name[]", keyed by nothing), or None for a guard that reads none (globals, the call's
    own arguments, a module's type)."""
    if "self" not in entry.name or entry.guard_type == "TYPE_MATCH":
        return None
    parts = [a or b or f"[{c}]" for a, b, c in re.findall(r"\.(\w+)|\['(\w+)'\]|\[(\d+)\]", entry.name)]
    parts = [x for x in parts if x not in ("_modules", "_parameters", "_buffers", "__dict__", "__mro__")]
    trailing = bool(parts) and parts[-1].startswith("[")
    names = [x for x in parts if not x.startswith("[") and not x.isdigit()]
    return (names[-1] + ("[]" if trailing else ""), entry.guard_type) if names else None


def unknown_values(guarded: set, traced: frozenset = TRACED_VALUES, fixed: frozenset = FIXED_VALUES) -> set:
    """The guarded (attribute, kind) pairs neither keyed (`traced`) nor fixed (`fixed`: attribute names)."""
    return {(a, k) for a, k in guarded if (a, k) not in traced and a not in fixed}


def module_guard_filter(entries) -> list:
    """dynamo's `guard_filter_fn` for a runner's compiled function: False for the guards in `_STATIC_MODULE_GUARDS` on
    sources inside its modules, True for every other (and for all, where this torch describes guards otherwise)."""
    keep = []
    for e in entries:
        try:
            static = e.guard_type in _STATIC_MODULE_GUARDS and e.orig_guard.source.is_unspecialized_nn_module()
        except AttributeError:
            static = False
        keep.append(not static)
    return keep


def compile_own(method, options=None, guard_filter=None):
    """torch.compile of a bound method through a copy of its code: dynamo keeps graphs and guards per code object, so
    the runner's are its own. Two models of one class in a process (engines, tests) then never reuse each other's
    graphs, which the guards `module_guard_filter` drops (their tensors' shapes) would otherwise no longer prevent,
    and a runner's graph count is its own. Static shapes; the runner's guard filter (`module_guard_filter` unless
    given) added to `options`."""
    f = method.__func__
    own = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    own.__kwdefaults__, own.__qualname__ = f.__kwdefaults__, f.__qualname__
    return torch.compile(types.MethodType(own, method.__self__), dynamic=False,
                         options={**(options or {}), "guard_filter_fn": guard_filter or module_guard_filter}), \
        own.__code__


def cuda_graph_options(model, capability: tuple, buckets: list) -> dict:
    """Inductor's options for this runner's CUDA graphs on a device of this compute capability (its own: an engine
    before it in the process, of another dtype, does not change them). The graphs are cut where attention runs (its
    key length varies), where the experts run unless `experts_in_cuda_graphs`, and where a tensor-parallel
    all-reduce or an expert dispatch runs (ops of the graph: outside the CUDA graphs, as when they cut the step into
    graphs; NCCL inside a capture is not what was chosen here); one graph a bucket is expected, not warned about. An
    older torch without graph partitions (< 2.9) would capture attention inside a CUDA graph, which its metadata from
    `step_context` cannot be: there the steps compile without CUDA graphs, with a warning."""
    config = torch._inductor.config
    if not hasattr(config, "custom_should_partition_ops") or not hasattr(config, "graph_partition"):
        log.warning("model.compile: this torch (%s) cannot cut CUDA graphs around attention: steps compile without "
                    "CUDA graphs", torch.__version__)
        return {}
    options = {"triton.cudagraphs": True}  # what mode="reduce-overhead" sets
    ops = ["dspark::step_attention"]
    moe = next(iter(model.moe_layers), None)
    if moe is not None and not experts_in_cuda_graphs(moe.w13, moe.w2, capability):
        ops.append("dspark::grouped_experts")
    if model.comm.tp_size > 1:
        ops.append("dspark::all_reduce")
    if moe is not None and moe.dispatch is not None:
        ops.append("dspark::expert_dispatch")
    options.update({"graph_partition": True, "custom_should_partition_ops": ops})
    if hasattr(config.triton, "cudagraph_dynamic_shape_warn_limit"):
        options["triton.cudagraph_dynamic_shape_warn_limit"] = len(buckets) + 1
    return options


def _entries(code) -> list:
    """The cache entries dynamo holds for this code's frame (a runner's own, `compile_own`): one a graph."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return _debug_get_cache_entry_list(code)


class DirectCalls:
    """A runner's compiled function called through its graphs' own code, without dynamo's guards (vLLM's dispatch).
    In situ dynamo's dispatch costs a call far more than its guard manager takes alone (0.1 ms a step at 4 layers on
    this CPU, ~1.5 ms at DeepSeek-V3's 61; 0.2-0.3 ms a drafter's round: BENCHMARKS.md, sessions 32-33). It is sound
    while the values the graphs' guards read are those they were last checked under: the call's own arguments, which
    the runner builds alike for every call of a kind (`probes`: their locals, one a size), dynamo's global state (one
    C check), and the module values the guards read, each either keyed (`traced`: the runner's `key()`, read before
    each call, changes with them; the target's steps read the mark of their latest assignment, `layers.traced_writes`,
    a drafter's rounds their static factors) or fixed for the runner's life (`fixed`); a value in neither
    (`guarded_values`, recorded by `guard_filter` as the runner compiles) keeps every call guarded: slower, never
    wrong. A changed key or global state takes the guarded call, which recompiles where the graphs read the value, and
    the functions are found again.

        direct = DirectCalls(traced, fixed)
        fn, code = compile_own(method, options, direct.guard_filter)
        ... the warm-up, through fn ...
        direct.start(code, globals, key, probes, allowed)    on where allowed and nothing unknown is read
        direct(fn, receiver, kind, *args) -> fn(*args)       directly where it may, else through fn
    """

    def __init__(self, traced: frozenset, fixed: frozenset):
        self.traced, self.fixed = traced, fixed
        self.guarded_values: set = set()  # (attribute, guard kind) of the kept guards on the runner's modules
        self.on = False
        self.calls = 0  # calls that ran their graph's code without dynamo's guards
        self.functions: dict = {}  # kind -> the graph's code as a function of (receiver, *args)
        self._code = self._globals = self._key_fn = self._probes = self._global_state = None
        self._key = self._graphs = None  # the key and graph count the functions were found under

    def guard_filter(self, entries) -> list:
        """The runner's `guard_filter_fn`: `module_guard_filter`, the module values its kept guards read recorded."""
        keep = module_guard_filter(entries)
        self.guarded_values |= {guarded_value(e) for e, k in zip(entries, keep) if k} - {None}
        return keep

    def unknown(self) -> set:
        return unknown_values(self.guarded_values, self.traced, self.fixed)

    def start(self, code, globals_: dict, key, probes, allowed: bool = True) -> None:
        """After the warm-up. code: the compiled frame's (`compile_own`); globals_: the method's; key() -> the keyed
        values now; probes() -> {kind: [the locals of a call of that kind, one a size]}; allowed: every call of a
        kind one whole graph, as the warm-up showed."""
        self._code, self._globals, self._key_fn, self._probes = code, globals_, key, probes
        unknown = self.unknown()
        if unknown:
            log.warning("model.compile: %s's graphs read %s, neither keyed nor fixed (compiled.TRACED_VALUES / "
                        "FIXED_VALUES): every call checks dynamo's guards", code.co_name, sorted(unknown))
        self.on = allowed and not unknown
        if self.on:
            self._find(key())

    def __call__(self, fn, receiver, kind, *args):
        if not self.on:
            return fn(*args)
        key = self._key_fn()
        run = self.functions.get(kind) if key == self._key else None
        if run is not None and self._global_state.check():
            self.calls += 1
            # (what torch.compile's entry does each call: inductor's CUDA graph trees start a new generation on it,
            # the previous call's outputs then overwritten, not kept by recording a graph more)
            torch._dynamo.mutation_guard.GenerationTracker.generation += 1
            return run(receiver, *args)
        out = fn(*args)
        if key != self._key or len(_entries(self._code)) != self._graphs or not self._global_state.check():
            self._find(key)
        return out

    def _find(self, key) -> None:
        """For each kind, the code of the graph whose guards pass for a call of every size of the kind (no function
        where sizes pick different graphs, or a call is cut into several)."""
        entries = [e for e in _entries(self._code) if not any(n.startswith("__resume_at") for n in e.code.co_names)]
        functions = {}
        for kind, probes in self._probes().items():
            found = {next((e.code for e in entries if e.guard_manager.check(p)), None) for p in probes}
            if len(found) == 1 and None not in found:
                functions[kind] = types.FunctionType(found.pop(), self._globals, self._code.co_name)
        self.functions, self._key, self._graphs = functions, key, len(_entries(self._code))
        self._global_state = torch._C._dynamo.guards.GlobalStateGuard()


class CompiledSteps:
    def __init__(self, model, buckets: list, device, captures: tuple = ((),)):
        """buckets: the token counts steps pad to (`compile_buckets`); captures: the layer tuples steps will capture
        (`model.forward`'s capture: a guard, so a graph each): () alone, or also the exported layers where a drafter
        reads them."""
        self.model, self.device = model, torch.device(device)
        self.buckets = list(buckets)
        self.captures = tuple(dict.fromkeys(tuple(c) for c in captures))
        options = None
        if self.device.type == "cuda":
            options = cuda_graph_options(model, torch.cuda.get_device_capability(self.device), self.buckets)
            allow_cuda_graph_sizes(len(self.buckets) + 1)
        # graphs of this runner's frame, a few a capture (at most one a bucket, where a token count is specialised):
        # past dynamo's limit of graphs a frame (8) the larger buckets would run eager, silently
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, len(self.buckets) * len(self.captures) + 1)
        # the direct dispatch (`forward`): on or off after the warm-up
        self.direct = DirectCalls(TRACED_VALUES, FIXED_VALUES)
        self.fn, self.code = compile_own(model.forward, options, self.direct.guard_filter)
        self.warm_up_s = 0.0
        self.graphs_at_warm_up = self.warm_up_graphs = None
        self.warm_up_graphs_by_bucket = None  # graphs each bucket's warm-up compiled: those past the second none
        # CUDA graphs (on CUDA): each stepping thread's tree manager, the graphs they recorded before their first
        # steps, and the seconds that took
        self.records_cuda_graphs = self.device.type == "cuda"
        self.cuda_graph_managers, self.cuda_graphs_at_warm_up, self.cuda_graph_skips_before = {}, None, None
        self.cuda_graph_functions: dict = {}  # thread id -> this runner's functions in its manager (`note_functions`)
        self.record_s = 0.0
        self.steps = self.verify_steps = 0  # steps run compiled, and of them those that verified drafts

    def applies(self, step) -> bool:
        return 0 < step.input_ids.numel() <= self.buckets[-1]

    def _padded(self, input_ids, positions, T, Tp=None):
        """The step's tokens padded to their bucket (or to Tp): ids, positions and the real-token mask."""
        Tp = Tp or bucket_of(T, self.buckets)
        ids = torch.zeros(Tp, dtype=torch.long)
        ids[:T] = input_ids
        pos = torch.zeros(Tp, dtype=torch.long)
        pos[:T] = positions
        ids, pos = ids.to(self.device), pos.to(self.device)
        real = torch.arange(Tp, device=self.device) < T
        if Tp > 1:  # one graph for every bucket past 1 (a size of 1 is specialised): compiled once, replayed by size
            for t in (ids, pos, real):
                torch._dynamo.mark_dynamic(t, 0)
        return ids, pos, real

    @torch.inference_mode()
    def __call__(self, step, capture: tuple = ()):
        """The step's hidden states [T, hidden], the padding rows cut off (and off the captured rows)."""
        if self.records_cuda_graphs and threading.get_ident() not in self.cuda_graph_managers:
            self.record_cuda_graphs()  # the first step on this thread: its graphs first, before it serves
        T = step.input_ids.numel()
        positions, meta = build_metadata(step.query_lens, step.context_lens, step.block_tables, step.block_size)
        ids, positions, real = self._padded(step.input_ids, positions, T)
        mark = functions_mark(self.device)
        with step_context(meta.to(self.device, self.model.lm_head.weight.dtype)):
            hidden = self.forward(ids, positions, capture, real)
        # (a graph recorded now, a size or a recompile the passes did not see, is a new function: this runner's)
        note_functions(self.cuda_graph_functions, self.device, mark)
        self.steps += 1
        self.verify_steps += step.num_draft is not None and bool(step.num_draft.any())
        if self.model.captured is not None:  # (held past the next step by the context stash: out of the graph's memory)
            self.model.captured = self.model.captured[:T].clone()
        return hidden[:T]

    def forward(self, ids, positions, capture: tuple, real):
        """The padded step's graphs. Dynamo checks ~80 guards a layer before a graph runs (~1.5 ms a step at
        DeepSeek-V3's 61 layers on a CPU host, BENCHMARKS.md): where no traced value was assigned since the graphs
        were last checked (`layers.traced_writes`) and the global state dynamo guards (grad mode, autocast, default
        dtype, deterministic algorithms, ...) is the one they were last checked under, the graph's own code is called
        directly (`DirectCalls`; the module values the guards read are traced, or fixed at load); otherwise the
        guarded call, which recompiles where needed."""
        return self.direct(self.fn, self.model, (ids.shape[0] == 1, capture), ids, positions, None, capture, real)

    def _probes(self) -> dict:
        """The locals of a padded step of each kind (one token or more, capture) and size, as the graphs' guards read
        them."""
        sizes = {True: [1], False: [b for b in self.buckets if b > 1]}
        return {(one, capture): [self._probe(n, capture) for n in tokens]
                for (one, tokens), capture in itertools.product(sizes.items(), self.captures) if tokens}

    def _probe(self, n: int, capture: tuple) -> dict:
        """The locals of a padded step of n tokens."""
        return {"self": self.model, "input_ids": torch.zeros(n, dtype=torch.long, device=self.device),
                "positions": torch.zeros(n, dtype=torch.long, device=self.device), "meta": None, "capture": capture,
                "real": torch.ones(n, dtype=torch.bool, device=self.device)}

    def _run_buckets(self, runs: int, on_bucket=None) -> None:
        """Every bucket and capture `runs` times with a step of padding rows only (one bucket at a time: on CUDA a
        warm-up run between another graph's warm-up and recording would move its memory)."""
        none = torch.zeros(0, dtype=torch.long)
        _, meta = build_metadata(none, none, torch.zeros(0, 1, dtype=torch.long), 1)
        for i, Tp in enumerate(self.buckets):
            t, before = time.perf_counter(), _graphs()
            ids, positions, real = self._padded(none, none, 0, Tp)
            with step_context(meta):
                for capture in self.captures:
                    for _ in range(runs):
                        self.fn(ids, positions, None, capture, real)
            self.model.captured = None  # (the padding rows' states: nobody reads them)
            if on_bucket is not None:
                on_bucket(i, Tp, _graphs() - before, time.perf_counter() - t)

    @torch.inference_mode()  # as the steps run: inference tensors (the guards check their dispatch keys)
    def warm_up(self) -> None:
        """Compile every bucket (one run each with a step of padding rows only: past the first two buckets a run
        compiles nothing, the token count being dynamic, but a size specialised would show here,
        `compile_warm_up_graphs_by_bucket`). CUDA graphs are recorded by the thread that steps
        (`record_cuda_graphs`): inductor's graph trees are per thread, and a Ray worker's steps run on its compiled
        graph's loop thread, not on the thread that warms it up; graphs recorded here would hold memory no step
        replays."""
        t0, mark = time.perf_counter(), functions_mark(self.device)
        if self.device.type == "cuda":
            self.cuda_graph_skips_before = _counter("inductor", "cudagraph_skips")
        self.warm_up_graphs_by_bucket = []

        def progress(i, Tp, graphs, seconds):
            self.warm_up_graphs_by_bucket.append(graphs)
            log.info("model.compile: bucket of %d tokens (%d/%d) in %.1f s", Tp, i + 1, len(self.buckets), seconds)
        self._run_buckets(1, progress)
        note_functions(self.cuda_graph_functions, self.device, mark)
        self.warm_up_s = time.perf_counter() - t0
        self.graphs_at_warm_up = _graphs()
        self.warm_up_graphs = sum(self.warm_up_graphs_by_bucket)
        # the direct dispatch (`forward`) where a step is one graph of each kind as expected
        self.direct.start(self.code, self.model.forward.__func__.__globals__, layers.traced_writes,
                          self._probes, self.warm_up_graphs == self.graphs_expected())
        log.info("model.compile: %d buckets compiled in %.1f s", len(self.buckets), self.warm_up_s)
        # a graph break cuts a step into several graphs (the collectives are ops of the graph: none by design)
        if self.warm_up_graphs > self.graphs_expected():
            log.warning("model.compile: %d graphs for %d buckets x %d captures, where %d were expected (graph "
                        "breaks or a token count specialised: more compile time)",
                        self.warm_up_graphs, len(self.buckets), len(self.captures), self.graphs_expected())

    @torch.inference_mode()
    def record_cuda_graphs(self) -> None:
        """Record this thread's CUDA graphs of every bucket and capture: two runs each (a graph tree warms a size up
        on its first run and records it on its second), before the thread's first step; the graphs recorded after
        it (`compile_cuda_graphs_after_warm_up`) should stay none."""
        t0, mark = time.perf_counter(), functions_mark(self.device)
        self._run_buckets(2)
        note_functions(self.cuda_graph_functions, self.device, mark)
        self.cuda_graph_managers[threading.get_ident()] = _cuda_graph_manager(self.device)
        self.cuda_graphs_at_warm_up = self.cuda_graphs()
        self.record_s += time.perf_counter() - t0
        log.info("model.compile: CUDA graphs of %d buckets recorded on this thread in %.1f s", len(self.buckets),
                 time.perf_counter() - t0)

    def cuda_graphs(self) -> int:
        """The CUDA graphs this runner's functions recorded on the threads that step (a piece of a step each)."""
        return _cuda_graphs(self.cuda_graph_managers, self.cuda_graph_functions)

    def graphs_expected(self) -> int:
        """The graphs the warm-up compiles, each step one whole graph (its collectives ops of the graph, not graph
        breaks: `dspark::all_reduce`, `dspark::expert_dispatch`): a capture's for one token and for the larger
        buckets."""
        return len(self.captures) * (1 + (self.buckets[-1] > 1))

    def stats(self) -> dict:
        graphs = _graphs()
        return {"compile_buckets": list(self.buckets), "compile_warm_up_s": self.warm_up_s,
                "compile_graphs": graphs, "compile_steps": self.steps, "compile_verify_steps": self.verify_steps,
                "compile_direct_steps": self.direct.calls,
                # a capture's for one token and for the larger buckets when each step is one whole graph (expected)
                "compile_warm_up_graphs": self.warm_up_graphs, "compile_graphs_expected": self.graphs_expected(),
                "compile_warm_up_graphs_by_bucket": self.warm_up_graphs_by_bucket,
                "compile_recompiles_after_warm_up": None if self.graphs_at_warm_up is None
                else graphs - self.graphs_at_warm_up,
                # on CUDA: the CUDA graphs each stepping thread recorded before its first step (a piece of a step each),
                # and any recorded since, while serving
                "compile_cuda_graphs_at_warm_up": self.cuda_graphs_at_warm_up, "compile_cuda_graph_record_s": self.record_s,
                "compile_cuda_graphs_after_warm_up": None if self.cuda_graphs_at_warm_up is None
                else self.cuda_graphs() - self.cuda_graphs_at_warm_up,
                # graphs inductor left without CUDA graphs (it logs why), since this runner's warm-up began
                "compile_cuda_graph_skips": None if self.cuda_graph_skips_before is None
                else _counter("inductor", "cudagraph_skips") - self.cuda_graph_skips_before}
