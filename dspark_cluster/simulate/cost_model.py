"""The device cost model: seconds for one step, from the step's shapes. Pure functions.

Every operation is a roofline: max(FLOPs / achievable FLOP/s, bytes / achievable HBM bandwidth),
whichever binds (a decode step's GEMMs read their weights for a few tokens: bandwidth; a prefill
chunk's are compute); on a device whose entry says `roofline: sum` (this CPU) their sum. Where the
devices are a host's cores (`host_cores`), the ranks of a multi-process run share them with the run's
other processes: every device term of a rank is divided by its share (`Device.rank_share`).
Collectives are latency + bytes / bandwidth, NVLink within a node and the network between nodes.
The layers of a step run in lockstep over the ranks (the experts' all-to-all is a barrier), so a
MoE layer takes the slowest data-parallel group's attention, the dispatch, the busiest EP rank's
experts and the combine: that busiest rank is where EPLB's effect shows. Units: seconds, FLOPs,
bytes; token counts are per data-parallel group.

`step_time` returns every term by name; they add up to "total" (with overlap, "overlap_saved"
is the negative term that makes them add up), which the tests check on a hand-computed step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .hardware import Device
from .shapes import ModelShapes


@dataclass(frozen=True)
class Topology:
    tensor: int  # TP ranks per data-parallel group
    data: int  # data-parallel groups (each its own batch and KV)
    gpus_per_node: int
    num_slots: int  # expert slots over the world (experts + redundant)

    @property
    def world(self) -> int:
        return self.tensor * self.data

    @property
    def num_nodes(self) -> int:
        return -(-self.world // self.gpus_per_node)


@dataclass(frozen=True)
class Precision:
    """Bytes per element and the GEMMs' dtype. DeepSeek's deployment: fp8 weights and GEMMs, fp8
    dispatch, bf16 combine, bf16 KV (its MLA cache)."""

    weight_bytes: float = 2.0
    act_bytes: float = 2.0
    kv_bytes: float = 2.0
    gemm_dtype: str = "bf16"
    attn_dtype: str = "bf16"
    dispatch_bytes: float = 2.0  # per hidden element sent to an expert
    combine_bytes: float = 2.0  # per hidden element sent back


@dataclass
class StepShape:
    """One step, per data-parallel group g (arrays [G]):

    tokens: tokens computed (prompt chunks, one per decode row, the drafts verified)
    sample_rows: rows that sample (logits are computed for these only)
    num_seqs: rows scheduled
    attn_pairs: sum over rows of (query token, key token) pairs attended (causal within a chunk)
    kv_read: sum over rows of the context tokens whose KV is read (once per row per layer)
    free_tokens: tokens whose compute is not on these devices (decode-only nodes: prompts' KV
        arrives from prefill nodes), left out of every term but the KV they take

    MoE (None without experts or on one rank): rank_tokens [L_moe, R] tokens routed to each rank's
    slots; rank_active [L_moe, R] experts with at least one token on it.
    Drafter: draft_rows, draft_tokens (per forward), draft_forwards; export_tokens: committed tokens
    whose hidden states go to the drafter."""

    tokens: np.ndarray
    sample_rows: np.ndarray
    num_seqs: np.ndarray
    attn_pairs: np.ndarray
    kv_read: np.ndarray
    free_tokens: Optional[np.ndarray] = None
    prefill_pairs: Optional[np.ndarray] = None  # the attn_pairs of prompt-chunk rows (MLA runs them unabsorbed)
    prefill_ctx: Optional[np.ndarray] = None  # their context tokens (MLA up-projects the latent of each)
    # a padded attention kernel's work (Device.attention_kernel "padded"): decode rows one batch, the
    # other rows another, each row attending its batch's longest query x longest context (whole blocks): the pairs
    # computed and the context tokens gathered; None: as attn_pairs and kv_read
    padded_pairs: Optional[np.ndarray] = None
    padded_kv: Optional[np.ndarray] = None
    rank_tokens: Optional[np.ndarray] = None
    rank_active: Optional[np.ndarray] = None
    draft_rows: int = 0
    draft_tokens: int = 0
    draft_forwards: int = 0
    export_tokens: int = 0


# ---- operations ---------------------------------------------------------------------------------
def gemm_time(tokens, params, dev: Device, prec: Precision, dtype: Optional[str] = None):
    """tokens [..] x a weight of `params` parameters: max(2 tokens params / FLOP/s, (weights +
    activations in and out) / bandwidth). A weight is read once per step, however many tokens."""
    tokens = np.asarray(tokens, dtype=np.float64)
    flops = 2.0 * tokens * params
    bytes_ = np.where(tokens > 0, params * prec.weight_bytes, 0.0)
    return dev.op_time(flops / dev.achievable_flops(dtype or prec.gemm_dtype), bytes_ / dev.achievable_hbm)


def expert_time(tokens, active, expert_params, dev: Device, prec: Precision):
    """One rank's routed experts in one layer: tokens [..] (token-expert assignments on its slots),
    active [..] experts with work (each one's weights are read): the grouped GEMM's roofline."""
    tokens = np.asarray(tokens, dtype=np.float64)
    flops = 2.0 * tokens * expert_params
    bytes_ = np.asarray(active, dtype=np.float64) * expert_params * prec.weight_bytes
    return dev.op_time(flops / dev.achievable_flops(prec.gemm_dtype), bytes_ / dev.achievable_hbm)


def attention_time(pairs, kv_read, m: ModelShapes, tp: int, dev: Device, prec: Precision, prefill_pairs=0.0):
    """One layer's attention core on one TP rank: pairs [..] x FLOPs per pair (its heads; the
    prefill_pairs among them, of prompt chunks, at the unabsorbed MLA rate), and the KV it reads:
    kv_read tokens x (MLA: the latent, whole on every rank; GQA: its KV heads)."""
    pairs = np.asarray(pairs, dtype=np.float64)
    prefill_pairs = np.asarray(prefill_pairs, dtype=np.float64)
    flops = (pairs - prefill_pairs) * m.attn_pair_flops(tp) + prefill_pairs * m.prefill_pair_flops(tp)
    bytes_ = np.asarray(kv_read, dtype=np.float64) * m.kv_elems_per_token_layer(tp) * prec.kv_bytes
    # a device entry may give attention kernels their own rate (the cpu entry: fitted, far from its GEMMs')
    rate = dev.achievable_flops("attention" if "attention" in dev.flops else prec.attn_dtype)
    return dev.op_time(flops / rate, bytes_ / dev.achievable_hbm)


def padded_attention_time(pairs, kv_read, m: ModelShapes, tp: int, dev: Device, prec: Precision):
    """One layer's attention core on one TP rank as this engine's eager kernel runs it
    (model/attention.py, SDPA over padded batches): pairs [..] padded (query, key) pairs at
    padded_pair_flops (MLA absorbed for every row), the additive mask read per head (fp32), and
    kv_read [..] context tokens gathered from the pool (a copy: read and written) then read by the
    kernel."""
    pairs = np.asarray(pairs, dtype=np.float64)
    flops = pairs * m.padded_pair_flops(tp)
    kv = np.asarray(kv_read, dtype=np.float64) * m.kv_elems_per_token_layer(tp) * prec.kv_bytes
    bytes_ = 3.0 * kv + pairs * (m.num_heads / tp) * 4.0
    rate = dev.achievable_flops("attention" if "attention" in dev.flops else prec.attn_dtype)
    return dev.op_time(flops / rate, bytes_ / dev.achievable_hbm)


def all_reduce_time(nbytes, n: int, bandwidth: float, latency: float):
    """Ring all-reduce of nbytes over n ranks: 2 (n-1)/n of the data crosses each link."""
    if n <= 1:
        return np.zeros_like(np.asarray(nbytes, dtype=np.float64))
    return latency + 2.0 * (n - 1) / n * np.asarray(nbytes, dtype=np.float64) / bandwidth


def all_gather_time(nbytes, n: int, bandwidth: float, latency: float):
    """All-gather of nbytes in total (each rank's share nbytes / n): (n-1)/n of it arrives per rank."""
    if n <= 1:
        return np.zeros_like(np.asarray(nbytes, dtype=np.float64))
    return latency + (n - 1) / n * np.asarray(nbytes, dtype=np.float64) / bandwidth


def all_to_all_time(nbytes, world: int, gpus_per_node: int, dev: Device):
    """Each rank sends nbytes spread evenly over all ranks: the share to ranks on its node goes over
    NVLink, the rest over the network, both at once; the slower decides. Latency: the network's
    when the world spans nodes."""
    if world <= 1:
        return np.zeros_like(np.asarray(nbytes, dtype=np.float64))
    nbytes = np.asarray(nbytes, dtype=np.float64)
    local = min(world, gpus_per_node)
    t_nvl = nbytes * (local - 1) / world / dev.nvlink_bandwidth
    t_net = nbytes * (world - local) / world / dev.network_bandwidth
    lat = dev.network_latency_s if world > gpus_per_node else dev.collective_latency_s
    return lat + np.maximum(t_nvl, t_net)


def node_deduped_all_to_all_time(tokens, top_k: int, bytes_per_token: float, world: int, gpus_per_node: int,
                                 dev: Device):
    """DeepEP's normal (prefill) kernels: a token crosses the network once per remote node that holds
    one of its top_k experts, then fans out over NVLink inside that node. tokens: sent by one rank;
    bytes_per_token: one copy (hidden x element bytes). Distinct nodes of k experts spread uniformly
    over N nodes: N (1 - (1 - 1/N)^k), of which (N - 1)/N remote."""
    if world <= 1:
        return np.zeros_like(np.asarray(tokens, dtype=np.float64))
    tokens = np.asarray(tokens, dtype=np.float64)
    nodes = max(1, -(-world // gpus_per_node))
    local = min(world, gpus_per_node)
    remote_nodes = nodes * (1 - (1 - 1 / nodes) ** top_k) * (nodes - 1) / nodes
    t_net = tokens * remote_nodes * bytes_per_token / dev.network_bandwidth
    t_nvl = tokens * top_k * bytes_per_token * (local - 1) / local / dev.nvlink_bandwidth
    lat = dev.network_latency_s if world > gpus_per_node else dev.collective_latency_s
    return lat + np.maximum(t_net, t_nvl)


# ---- one step -----------------------------------------------------------------------------------
def _device_terms(s: StepShape, m: ModelShapes, topo: Topology, dev: Device, prec: Precision, scale: float,
                  dispatch: str = "per_expert") -> dict:
    """Per-layer-kind seconds of the target's forward for the step's tokens x scale (scale 0.5:
    one of two micro-batches). Returns the terms summed over layers."""
    tp = topo.tensor
    free = s.free_tokens if s.free_tokens is not None else 0.0
    tok = np.maximum(np.asarray(s.tokens, dtype=np.float64) - free, 0.0) * scale  # [G]
    frac = np.divide(tok, np.maximum(np.asarray(s.tokens, dtype=np.float64) * scale, 1e-12))
    pairs = np.asarray(s.attn_pairs, dtype=np.float64) * scale * frac
    kv = np.asarray(s.kv_read, dtype=np.float64) * scale * frac
    attn_proj = gemm_time(tok, m.attn_params / tp, dev, prec)
    pp = 0.0 if s.prefill_pairs is None else np.asarray(s.prefill_pairs, dtype=np.float64) * scale * frac
    if dev.attention_kernel == "padded" and s.padded_pairs is not None:
        attn_core = padded_attention_time(np.asarray(s.padded_pairs, dtype=np.float64) * scale * frac,
                                          np.asarray(s.padded_kv, dtype=np.float64) * scale * frac, m, tp, dev, prec)
    else:
        attn_core = attention_time(pairs, kv, m, tp, dev, prec, pp)
    if s.prefill_ctx is not None and m.kv_up_params and dev.attention_kernel != "padded":
        attn_core = attn_core + gemm_time(np.asarray(s.prefill_ctx, dtype=np.float64) * scale * frac,
                                          m.kv_up_params / tp, dev, prec)
    mlp = gemm_time(tok, m.mlp_params / tp, dev, prec)
    shared = gemm_time(tok, m.shared_params / tp, dev, prec) + gemm_time(tok, m.gate_params, dev, prec)
    act = tok * m.hidden * prec.act_bytes
    tp_ar = all_reduce_time(act, tp, dev.nvlink_bandwidth, dev.collective_latency_s)  # [G], one all-reduce
    sample = np.asarray(s.sample_rows, dtype=np.float64) * scale * frac
    lm_head = gemm_time(sample, m.lm_head_params / tp, dev, prec)
    logits = all_gather_time(sample * m.vocab * 4.0, tp, dev.nvlink_bandwidth, dev.collective_latency_s)
    L, Lm = m.num_layers, m.num_moe_layers
    # ranks that share a host's cores with the run's other processes compute slower (1 on GPUs)
    slow = 1.0 / dev.rank_share(min(topo.world, topo.gpus_per_node))
    lm_head = lm_head * slow
    t = {
        # the slowest group sets the pace of each layer (all ranks meet in the all-to-all)
        "attention": L * float(np.max(attn_core)),
        "dense_gemm": L * float(np.max(attn_proj)) + (L - Lm) * float(np.max(mlp)) + Lm * float(np.max(shared)),
        "lm_head": float(np.max(lm_head + logits)),
        "tp_comm": 2 * L * float(np.max(tp_ar)),
        "moe": 0.0,
        "ep_comm": 0.0,
        "launch": L * dev.layer_overhead_s if float(np.max(tok)) > 0 else 0.0,
        "rows": L * dev.row_overhead_s * float(np.max(np.asarray(s.num_seqs, dtype=np.float64) * frac)),
    }
    if Lm and s.rank_tokens is not None and topo.world > 1:
        rt = np.asarray(s.rank_tokens, dtype=np.float64) * scale
        per_rank = expert_time(rt, s.rank_active, m.expert_params, dev, prec)  # [L_moe, R]
        t["moe"] = float(per_rank.max(axis=1).sum())  # the busiest rank, layer by layer
        # each TP rank dispatches its share of its group's tokens; the busiest group's sends set the time
        if dispatch == "per_node":
            sent_tokens = float(np.max(tok)) / tp
            t["ep_comm"] = Lm * float(sum(
                node_deduped_all_to_all_time(sent_tokens, m.top_k, m.hidden * b, topo.world, topo.gpus_per_node, dev)
                for b in (prec.dispatch_bytes, prec.combine_bytes)))
        else:
            sent = float(np.max(tok)) / tp * m.top_k * m.hidden
            t["ep_comm"] = Lm * float(all_to_all_time(sent * prec.dispatch_bytes, topo.world, topo.gpus_per_node, dev)
                                      + all_to_all_time(sent * prec.combine_bytes, topo.world, topo.gpus_per_node, dev))
    elif Lm:  # one rank holds every expert: each token's top-k experts run here
        active = min(m.num_experts, float(np.max(tok)) * m.top_k)
        t["moe"] = Lm * float(expert_time(float(np.max(tok)) * m.top_k, active, m.expert_params, dev, prec))
    for k in ("attention", "dense_gemm", "moe", "launch", "rows"):
        t[k] *= slow
    return t


def drafter_time(draft_tokens: float, forwards: int, params: float, layers: int, dev: Device,
                 prec: Precision) -> float:
    """The drafter's proposals of one step: `forwards` forwards of draft_tokens tokens through
    `params` parameters in `layers` layers, and the host's call (the engine waits for them)."""
    if not (forwards and params):
        return 0.0
    per = float(gemm_time(draft_tokens, params, dev, prec)) + layers * dev.layer_overhead_s
    return forwards * per + dev.host_overhead_s


COMPUTE_TERMS = ("attention", "dense_gemm", "lm_head", "moe", "launch", "rows")
COMM_TERMS = ("tp_comm", "ep_comm")


def step_time(s: StepShape, m: ModelShapes, topo: Topology, dev: Device, prec: Precision, *,
              overlap: bool = False, drafter_params: float = 0.0, drafter_layers: int = 0,
              drafter_dev: Optional[Device] = None,
              export_bytes_per_token: float = 0.0, host_seqs: Optional[float] = None,
              async_host: bool = False, dispatch: str = "per_expert") -> dict:
    """Seconds of one step, by term; the terms add up to "total".

    overlap: DeepSeek's dual micro-batch: the batch runs as two halves, one's communication under the
    other's compute, so the forward takes max(compute, communication) of the two halves together
    (each half reads the weights again: that is its price). drafter_params, drafter_layers: one
    drafter forward's parameters and layers over draft_tokens tokens (on drafter_dev, default the target's), run before
    the step (the engine waits for the proposals). export_bytes_per_token: hidden-state bytes per
    committed token sent to the drafter. host_seqs: sequences the host handles per step (default
    every group's: one Router schedules them all). async_host: the host's work overlaps the
    device's (async scheduling): max instead of a sum, unless the ranks already take every core of
    a shared host (`host_cores`): then the host's work takes its cores from them and adds up.
    dispatch: per_expert (a copy per routed expert, DeepEP's low-latency decode kernels) or per_node
    (a copy per remote node, its normal kernels)."""
    if overlap:
        half = _device_terms(s, m, topo, dev, prec, 0.5, dispatch)
        t = {k: 2 * v for k, v in half.items()}
        compute = sum(t[k] for k in COMPUTE_TERMS)
        comm = sum(t[k] for k in COMM_TERMS)
        t["overlap_saved"] = max(compute, comm) - (compute + comm)
    else:
        t = _device_terms(s, m, topo, dev, prec, 1.0, dispatch)
        t["overlap_saved"] = 0.0
    t["drafter"] = drafter_time(s.draft_tokens, s.draft_forwards, drafter_params, drafter_layers, drafter_dev or dev,
                                prec)
    t["export"] = s.export_tokens * export_bytes_per_token / dev.host_link_bandwidth if s.export_tokens else 0.0
    seqs = float(np.sum(s.num_seqs)) if host_seqs is None else host_seqs
    host = dev.host_overhead_s + dev.per_seq_overhead_s * seqs + dev.per_token_overhead_s * float(np.sum(s.tokens))
    device = sum(v for k, v in t.items())
    if async_host and dev.rank_share(min(topo.world, topo.gpus_per_node)) >= 1.0:
        t["host"] = max(0.0, host - device)  # only what the device's time does not hide
    else:
        t["host"] = host
    t["total"] = sum(t.values())
    return t


def profile_grid(m: ModelShapes, topo: Topology, dev: Device, prec: Precision, max_rows: int, max_tokens: int,
                 context: int = 1, **kw) -> tuple[list[int], list[float]]:
    """T(B) on a grid of B, as `speculative.controller.profile_step_cost` measures it at start-up
    (min(B, max_rows) rows of B / rows tokens, the experts evenly loaded): the simulated device's
    StepCost for the verify budget."""
    grid = sorted({min(2 ** i, max_tokens) for i in range(max_tokens.bit_length() + 1)} | {max_tokens})
    xs, ys = [], []
    for B in grid:
        rows = min(B, max_rows)
        q = -(-B // rows)
        tokens = np.full(topo.data, float(rows * q))
        shape = StepShape(tokens=tokens, sample_rows=np.full(topo.data, float(rows)),
                          num_seqs=np.full(topo.data, float(rows)),
                          attn_pairs=np.full(topo.data, rows * (q * context + q * (q + 1) / 2.0)),
                          kv_read=np.full(topo.data, float(rows * (context + q))))
        if m.num_moe_layers and topo.world > 1:
            per = float(tokens.sum()) * m.top_k / topo.world
            slots = topo.num_slots / topo.world
            shape.rank_tokens = np.full((m.num_moe_layers, topo.world), per)
            shape.rank_active = np.full((m.num_moe_layers, topo.world), min(slots, per))
        if rows * q not in xs:
            xs.append(rows * q)
            ys.append(step_time(shape, m, topo, dev, prec, **kw)["total"])
    return xs, ys
