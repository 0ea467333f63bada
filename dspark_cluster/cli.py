"""`dspark run [CONFIG] [--set key.path=value ...]`: run an experiment on a config."""

from __future__ import annotations

import argparse
import sys

from .config import load_config
from .errors import DSparkError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dspark", description="DSpark Cluster: MoE serving experiments")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the workload of a config and write a report")
    run.add_argument("config", nargs="?", default=None, help="YAML config (default: the bundled configs/tiny.yaml)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                     help="override a config value, e.g. --set scheduler.max_num_seqs=16 (repeatable)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.command == "run":
            from .runner import format_summary, run_experiment

            report = run_experiment(cfg, progress=not args.no_progress)
            print(format_summary(report["summary"]))
            print(f"report: {report['out_dir']}/report.json")
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
