"""`dspark simulate`: a run's YAML on the simulated engine, and the same report as `dspark run`
(summary, requests.csv, the plots, the cost ledger), marked simulated."""

from __future__ import annotations

import itertools
import json
import logging
import time
from pathlib import Path
from typing import Optional

import torch

from ..config import ASSETS_DIR, Config
from ..cost import cost_ledger, device_kind
from ..config_checks import DSPARK_MODEL_TYPE
from ..errors import ConfigError
from ..model.spec import load_spec
from ..report import add_expert_summary, save_report, summarize
from ..sequence import Sequence
from ..speculative.dspark_model import DSparkConfig, context_window_of, resolve_draft_passes
from .engine import DrafterFigures, SimEngine
from .hardware import get_device
from .options import SimOptions
from .shapes import dense_params
from .traffic import read_trace, survival_from_report, workload_requests

log = logging.getLogger(__name__)

DEFAULT_CONDITIONAL_ACCEPTANCE = 0.8  # per position, when no survival curve is given (an assumption)


def hardware_name(cfg: Config, opts: SimOptions) -> str:
    """auto: this CPU for a config that runs on CPU here (device cpu; in process without CUDA; or a
    bundled tiny model, which only the CPU runs), else H200 (the shipped GPU topologies')."""
    if opts.hardware != "auto":
        return opts.hardware
    bundled = Path(cfg.model.path).resolve().is_relative_to(ASSETS_DIR.resolve())
    if cfg.parallel.device == "cpu" or bundled or (cfg.parallel.device == "auto" and not torch.cuda.is_available()
                                                   and cfg.parallel.executor == "local"):
        return "cpu"
    return "H200"


def drafter_figures(cfg: Config, opts: SimOptions) -> DrafterFigures:
    """The drafter's figures from its config.json (the options override its size and export)."""
    sp = cfg.speculative
    params, export, window, layers, passes = 0.0, 0, 0, 0, 1
    if sp.enabled and sp.draft_model:
        raw = json.loads((Path(sp.draft_model) / "config.json").read_text())
        if raw.get("model_type") == DSPARK_MODEL_TYPE:
            c = DSparkConfig.load(Path(sp.draft_model) / "config.json")
            export, window, layers = len(c.target_layer_ids), context_window_of(sp.context_window, c), c.num_layers
            # auto: as the simulated hardware would resolve it (a CPU serves one pass, a GPU the drafter's own)
            passes = resolve_draft_passes(sp.draft_passes, c, sp.draft_model,
                                          "cpu" if hardware_name(cfg, opts) == "cpu" else "cuda")
            params = dense_params(c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_heads,
                                  c.head_dim, c.vocab_size)
            params += export * c.target_hidden_size * c.hidden_size + 2 * c.vocab_size * c.markov_rank
        else:
            d = load_spec(sp.draft_model)
            layers = d.num_layers
            params = dense_params(d.num_layers, d.hidden_size, d.intermediate_size, d.num_heads, d.num_kv_heads,
                                  d.head_dim, d.vocab_size)
    if opts.drafter_params is not None:
        params = opts.drafter_params
    if opts.export_layers is not None:
        export = opts.export_layers
    return DrafterFigures(float(params), int(export), int(window), int(layers), int(passes))


def survival_curve(cfg: Config, opts: SimOptions) -> Optional[list]:
    a = opts.acceptance
    if not cfg.speculative.enabled:
        return None
    if a.survival:
        return list(a.survival)
    if a.report:
        return survival_from_report(a.report)
    k = cfg.speculative.num_tokens
    return [DEFAULT_CONDITIONAL_ACCEPTANCE ** (j + 1) for j in range(k)]


def build(cfg: Config, opts: SimOptions):
    """The simulated engine and the requests to replay."""
    spec = load_spec(cfg.model.path, cfg.model.dtype)
    name = hardware_name(cfg, opts)
    dev = get_device(name, opts.hardware_file)
    ddev = get_device(opts.drafter_hardware, opts.hardware_file) if opts.drafter_hardware else dev
    engine = SimEngine(cfg, spec, opts, dev, ddev, drafter_figures(cfg, opts), survival_curve(cfg, opts))
    encode = None
    if opts.trace is None and cfg.workload.kind != "synthetic":
        from ..input_processor import load_tokenizer

        tok = load_tokenizer(cfg.model.tokenizer or cfg.model.path)
        if tok is not None:
            encode = lambda text: list(tok(text)["input_ids"])  # noqa: E731 -- as InputProcessor.encode
    if opts.trace:
        requests = read_trace(opts.trace, spec.vocab_size, opts.seed, cfg.workload.temperature)
    else:
        requests = workload_requests(cfg, spec.vocab_size, encode=encode)
    return engine, requests


def simulate(cfg: Config, opts: Optional[SimOptions] = None, write: bool = True) -> dict:
    """Simulate cfg's workload; the report dict (also written under report.out_dir/<name>/)."""
    opts = opts or SimOptions()
    check_options(cfg, opts)
    t0 = time.perf_counter()
    engine, requests = build(cfg, opts)
    cap = engine.num_blocks * engine.block_size
    limit = min(engine.max_model_len - 1, cap - 1)
    truncated = 0
    ids_made = itertools.count()

    def make_seq(r) -> Sequence:
        nonlocal truncated
        ids = r.prompt_ids
        if len(ids) > limit:  # the real engine refuses it; the simulation keeps the run going, shorter
            ids, truncated = ids[:limit], truncated + 1
        return Sequence(f"sim-{next(ids_made)}", list(ids), len(ids), r.params, engine.spec.eos_token_ids,
                        arrival_time=r.arrival_s)

    seqs = engine.run(requests, make_seq)
    wall = time.perf_counter() - t0
    rows = [dict(request_id=s.request_id, finish_reason=s.finish_reason, **s.metrics()) for s in seqs]
    duration = engine.now
    preemptions = sum(r["num_preemptions"] for r in rows)
    summary = summarize(rows, engine.step_record, duration, engine.num_blocks * engine.num_groups, preemptions)
    if not engine.opts.record_steps:
        summary["steps"] = engine.num_steps
    dev, world = engine.dev, engine.topo.world
    summary.update(simulated_summary(engine, summary, wall, truncated))
    spec_summary = speculative_summary(engine)
    if spec_summary:
        summary["speculative"] = spec_summary
    experts = engine.expert_summary()
    add_expert_summary(summary, experts, world)
    report = {"simulated": True, "config": cfg.to_dict(), "simulation": simulation_section(engine, opts),
              "summary": summary, "cost": ledger(engine, cfg, duration, len(rows)), "requests": rows,
              "steps": engine.step_record, "experts": experts}
    if write:
        save_report(report, cfg, "sim")
    log.info("simulated %d requests, %d steps in %.1f s on %s", len(rows), engine.num_steps, wall, dev.name)
    return report


def simulated_summary(engine: SimEngine, summary: dict, wall_s: float, truncated: int) -> dict:
    dev, world = engine.dev, engine.topo.world
    nodes = engine.topo.num_nodes
    tps = summary["output_tokens_per_s"]
    duration = summary["duration_s"] or float("nan")
    return {
        "simulated": True,
        "hardware": dev.name,
        "devices": world,
        "nodes": nodes,
        "output_tokens_per_s_per_device": tps / world,
        "output_tokens_per_s_per_node": tps / nodes,
        "input_tokens_per_s_per_node": engine.tokens["prompt"] / duration / nodes,
        "output_tokens_per_s_per_user_p50": (1.0 / summary["tpot_p50_s"]) if summary.get("tpot_p50_s")
        else float("nan"),
        "mean_kv_tokens_per_seq": _mean_kv(engine),
        "simulation_wall_s": wall_s,
        "prompts_truncated": truncated,
    }


def _mean_kv(engine: SimEngine) -> float:
    """Mean context per decode row over the run's steps (the figure DeepSeek quotes as average KV)."""
    steps = engine.step_record
    if not steps:
        return float("nan")
    kv = [s["kv_blocks_used"] * engine.block_size / max(1, s["num_seqs"]) for s in steps if s["num_seqs"]]
    return sum(kv) / len(kv) if kv else float("nan")


def speculative_summary(engine: SimEngine) -> Optional[dict]:
    """The engine's speculative summary (SpecStats over the simulated verify rounds: acceptance by
    position as drawn, not the survival curve given), plus what only the simulation knows."""
    if not engine.speculating:
        return None
    steps = engine.step_record
    verified = sum(s["num_verified"] for s in steps)
    drafted = sum(s["num_drafted"] for s in steps)
    out = engine.spec_stats.summary()
    out.update({"draft_time_s": engine.terms_total.get("drafter", 0.0), "verify_time_s": float("nan"),
                "schedule": engine.cfg.speculative.schedule,
                "survival_given": engine.acceptance.cond.cumprod().tolist(),
                "verified_share": verified / drafted if drafted else float("nan"),
                "num_drafted_positions": drafted, "num_verified": verified,
                "steps_verifying": sum(1 for s in steps if s["num_verified"])})
    if engine.planner is not None:
        out["calibration"] = {"mean_survival": None if engine.planner.mean_survival is None
                              else engine.planner.mean_survival.round(4).tolist(),
                              "temperatures": engine.planner.temps.round(3).tolist(),
                              "step_cost": engine.planner.step_cost.table()}
    return out


def simulation_section(engine: SimEngine, opts: SimOptions) -> dict:
    total = engine.terms_total.get("total", 0.0) or float("nan")
    return {
        "hardware": engine.dev.model_dump(),
        "options": opts.model_dump(),
        "topology": {"tensor": engine.topo.tensor, "data": engine.topo.data, "world": engine.topo.world,
                     "nodes": engine.topo.num_nodes, "gpus_per_node": engine.topo.gpus_per_node,
                     "expert_slots": engine.num_slots},
        "precision": vars(engine.prec),
        "memory_per_rank": engine.memory,
        "time_by_term_s": {k: v for k, v in engine.terms_total.items()},
        "time_share_by_term": {k: v / total for k, v in engine.terms_total.items() if k != "total"},
        "steps": engine.num_steps,
    }


def ledger(engine: SimEngine, cfg: Config, duration: float, num_requests: int) -> dict:
    """The cost ledger (cost.cost_ledger) of the simulated devices: every target rank held for the
    run, its weights and KV pool; busy = the simulated forward time on each."""
    kind = device_kind("cpu" if engine.dev.name == "cpu" else "cuda")
    mem = engine.memory
    devices = [{"role": "target", "rank": r, "kind": kind,
                "memory": {"weights": mem["weight_bytes"], "kv_pool": mem["kv_bytes_per_block"] * mem["num_blocks"],
                           "kv_peak_used": mem["kv_bytes_per_block"] * engine.kv_peak_blocks}}
               for r in range(engine.topo.world)]
    busy = {"target": engine.busy_s * engine.topo.world}
    if engine.speculating and cfg.parallel.executor == "ray" and not engine.on_target:  # (else the target's devices)
        devices += [{"role": "drafter", "rank": r, "kind": kind, "memory": {}}
                    for r in range(cfg.speculative.draft_workers)]
        busy["drafter"] = engine.terms_total.get("drafter", 0.0) * cfg.speculative.draft_workers
    tokens = {**engine.tokens, "recomputed": sum(g.num_recomputed_tokens for g in engine.schedulers)}
    prices = cfg.cost.price_per_device_hour.model_dump()
    return cost_ledger(duration, devices, busy, tokens, {k: int(v) for k, v in engine.comm_bytes.items()}, prices,
                       num_requests)


def check_options(cfg: Config, opts: SimOptions) -> None:
    """What the simulation cannot run, as one error naming each problem."""
    problems = []
    if opts.expert_load.kind == "report" and not opts.expert_load.report:
        problems.append("--sim expert_load.report: kind 'report' needs a report.json path")
    if opts.trace and not Path(opts.trace).is_file():
        problems.append(f"--sim trace: got {opts.trace!r}; no such JSONL file")
    if cfg.speculative.enabled and cfg.speculative.method in ("dspark", "draft_model") and not (
            cfg.speculative.draft_model or opts.drafter_params is not None):
        problems.append("--sim drafter_params: the drafter's size is unknown; give speculative.draft_model or it")
    if problems:
        raise ConfigError(problems)
