"""Command line: `dspark run`, `dspark simulate`, `dspark sweep`, `dspark compare`, `dspark kv-plan`, `dspark serve` and
`dspark drafter status|rollback|resume`."""

from __future__ import annotations

import argparse
import os
import sys

from .config import load_config
from .errors import DSparkError
from .http_edge import HTTPLimits


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dspark", description="DSpark Cluster: MoE serving on Ray")
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(cmd):
        cmd.add_argument("config", nargs="?", default=None, help="YAML config (default: the bundled configs/tiny.yaml)")
        cmd.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                         help="override a config value, e.g. --set scheduler.max_num_seqs=16 (repeatable)")
        return cmd

    run = with_config(sub.add_parser("run", help="run the config's workload and write a report"))
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    plan = with_config(sub.add_parser("kv-plan", help="KV cache capacity per worker"))
    plan.add_argument("--context-len", type=int, default=None, help="context length for the sequences-at-once column")
    plan.add_argument("--device-memory", default=None, metavar="SIZE",
                      help="plan for devices of this memory (e.g. 141GB for an H200, 80GB for an H100) from any "
                           "machine; default: this machine's device")
    serve = with_config(sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)"))
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1/* and /admin/*. Default and safer: the "
                            "DSPARK_API_KEY environment variable (a key given here is visible to every user of "
                            "the machine in ps); neither: no key")
    serve.add_argument("--served-model-name", default=None, help="the model name clients send (default: the model folder's name)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument("--max-body-mb", type=float, default=8.0,
                       help="refuse request bodies over this many MiB with a 413 (default 8; 0: no limit)")
    limits = HTTPLimits()
    serve.add_argument("--header-timeout", type=float, default=limits.header_timeout_s, metavar="S",
                       help="close a connection whose request line and headers take longer than this "
                            f"(default {limits.header_timeout_s:g} s)")
    serve.add_argument("--body-timeout", type=float, default=limits.body_timeout_s, metavar="S",
                       help="close a connection whose request body takes longer than this after its headers, "
                            f"with a 408 (default {limits.body_timeout_s:g} s)")
    serve.add_argument("--keep-alive", type=float, default=limits.keep_alive_s, metavar="S",
                       help=f"close an idle connection between requests after this (default {limits.keep_alive_s:g} s)")
    serve.add_argument("--max-connections", type=int, default=limits.max_connections, metavar="N",
                       help="answer a connection beyond this many open ones with a 503 and close it "
                            f"(default {limits.max_connections}; keep it under the open-files limit, ulimit -n)")
    serve.add_argument("--openapi", action="store_true",
                       help="serve the OpenAPI schema at /openapi.json, behind the API key (default: off)")
    compare = sub.add_parser("compare", help="two runs side by side, with the gain/cost figure and a verdict")
    compare.add_argument("run_a", help="the baseline: a run's folder (with report.json) or its report.json")
    compare.add_argument("run_b", help="the change, likewise")
    sweep = with_config(sub.add_parser("sweep", help="run the config over a grid of values; a table and plots"))
    sweep.add_argument("--grid", action="append", default=[], metavar="KEY.PATH=V1,V2",
                       help="values to sweep, e.g. --grid parallel.tensor=1,2 (repeatable; every combination "
                            "runs); a YAML flow list sets several keys per value: --grid 'speculative=[{method: "
                            "none}, {method: dspark, draft_model: tiny-dspark}]'")
    sweep.add_argument("--name", default=None, help="the sweep's folder under report.out_dir (default: sweep-<time>)")
    from .simulate.cli import add_simulate_arguments

    add_simulate_arguments(sub, with_config, sweep)  # `dspark simulate`, `dspark sweep --simulate`
    drafter = sub.add_parser("drafter", help="online drafter calibration on a running server: status, rollback "
                             "(holds the version), resume (lets calibrated versions publish again)")
    drafter.add_argument("action", choices=["status", "rollback", "resume"])
    drafter.add_argument("--version", type=int, default=None,
                         help="rollback: the version to serve (default: the original, uncalibrated weights)")
    drafter.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    drafter.add_argument("--api-key", default=None, help="its API key (default: the DSPARK_API_KEY variable)")
    return p


def _http_limits(args) -> HTTPLimits:
    """`dspark serve`'s connection limits; a bad value is a ConfigError naming the flag."""
    from .errors import ConfigError

    flags = {"header_timeout_s": "--header-timeout", "body_timeout_s": "--body-timeout", "keep_alive_s": "--keep-alive",
             "max_connections": "--max-connections"}
    values = {field: getattr(args, flag[2:].replace("-", "_")) for field, flag in flags.items()}
    bad = [f"{flags[k]}: got {v!r}; must be positive" for k, v in values.items() if not v > 0]
    if bad:
        raise ConfigError(bad)
    return HTTPLimits(**values)


def _drafter_command(args) -> int:
    """GET /admin/drafter or POST /admin/drafter/rollback, printing the JSON answer."""
    import json
    import urllib.error
    import urllib.request

    key = args.api_key or os.environ.get("DSPARK_API_KEY")
    url = args.url.rstrip("/") + {"status": "/admin/drafter", "rollback": "/admin/drafter/rollback",
                                  "resume": "/admin/drafter/resume"}[args.action]
    data = {"status": None, "rollback": json.dumps({"version": args.version}).encode(), "resume": b"{}"}[args.action]
    req = urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        print(f"error: {url} answered {e.code}: {detail}", file=sys.stderr)
        return 1
    except urllib.error.URLError as e:
        print(f"error: cannot reach {url}: {e.reason}", file=sys.stderr)
        return 1
    if args.action != "status":
        print(f"serving drafter version {body.get('serving_version')}"
              f"{' (held: nothing publishes until resume)' if body.get('pinned') else ''}")
    print(json.dumps(body, indent=2))
    return 0


def _load_report(path: str) -> dict:
    """A run's report.json (given its folder or the file), with its cost ledger."""
    import json
    from pathlib import Path

    from .errors import ConfigError

    p = Path(path)
    f = p / "report.json" if p.is_dir() else p
    if not f.is_file():
        raise ConfigError(f"{path}: no report.json there; give a run's folder (runs/<name>) or its report.json")
    report = json.loads(f.read_text())
    if not report.get("cost"):
        raise ConfigError(f"{f}: the report has no cost ledger (written before the ledger existed); run it again")
    return report


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "drafter":
        return _drafter_command(args)
    if args.command == "compare":
        from .cost import format_comparison

        try:
            a, b = _load_report(args.run_a), _load_report(args.run_b)
        except DSparkError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(format_comparison(a, b, "A", "B"))
        return 0
    if args.command == "simulate":
        from .simulate.cli import simulate_command

        return simulate_command(args)
    if args.command == "sweep":
        from .sweep import parse_grid, run_sweep

        try:
            from .simulate.cli import sweep_runner

            result = run_sweep(args.config, parse_grid(args.grid), args.overrides, name=args.name,
                               run=sweep_runner(args))
        except DSparkError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(open(f"{result['out_dir']}/sweep.md").read())
        return 0 if any(r["status"] == "ok" for r in result["points"]) else 1
    try:
        cfg = load_config(args.config, args.overrides)
        if args.command == "run":
            from .report import format_summary
            from .runner import run_experiment

            report = run_experiment(cfg, progress=not args.no_progress)
            print(format_summary(report["summary"], report.get("cost")))
            print(f"report: {report['out_dir']}/")
        elif args.command == "kv-plan":
            from .kv_plan import format_kv_plan, kv_plan
            from .model.spec import load_spec

            from .config import parse_bytes

            memory = parse_bytes(args.device_memory, "--device-memory") if args.device_memory else None
            print(format_kv_plan(kv_plan(cfg, load_spec(cfg.model.path, cfg.model.dtype), args.context_len, memory)))
        elif args.command == "serve":
            from .server import serve

            api_key = args.api_key or os.environ.get("DSPARK_API_KEY") or None
            serve(cfg, host=args.host, port=args.port, api_key=api_key,
                  served_model_name=args.served_model_name, log_level=args.log_level,
                  max_body_bytes=int(max(args.max_body_mb, 0) * 2**20) or None, limits=_http_limits(args),
                  openapi=args.openapi)
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
