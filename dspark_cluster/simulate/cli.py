"""`dspark simulate CONFIG [--set ...] [--hardware NAME] [--sim KEY=VALUE ...]` and
`dspark sweep CONFIG --simulate --grid ...`: the arguments and the commands (cli.py wires them in)."""

from __future__ import annotations

import sys

SIM_HELP = ("a simulation option (simulate/options.py SimOptions), e.g. --sim expert_load.skew=1.2, "
            "--sim overlap=true, --sim role=decode, --sim acceptance.survival=[0.8,0.6,0.45] (repeatable)")


def add_simulate_arguments(sub, with_config, sweep) -> None:
    """The `simulate` command, and `--simulate` (with the same options) on `sweep`."""
    sim = with_config(sub.add_parser("simulate", help="simulate the config's run on a modelled cluster (no devices, no "
                                                      "weights: the real scheduler, KV manager, verify budget, EPLB)"))
    for cmd in (sim, sweep):
        cmd.add_argument("--hardware", default=None, metavar="NAME",
                         help="a device of the catalog (dspark_cluster/assets/hardware.yaml): H800, H100, H200, B200, "
                              "cpu (default: cpu for a CPU config, else H200)")
        cmd.add_argument("--hardware-file", default=None, metavar="YAML", help="another hardware catalog")
        cmd.add_argument("--sim", dest="sim", action="append", default=[], metavar="KEY.PATH=VALUE", help=SIM_HELP)
    sweep.add_argument("--simulate", action="store_true", help="simulate every point instead of running it")


def options(args):
    from .options import load_options

    values = {}
    if args.hardware:
        values["hardware"] = args.hardware
    if args.hardware_file:
        values["hardware_file"] = args.hardware_file
    return load_options(values, args.sim)


def simulate_command(args) -> int:
    from ..config import load_config
    from ..errors import DSparkError
    from ..report import format_summary
    from .run import simulate

    try:
        cfg = load_config(args.config, args.overrides)
        report = simulate(cfg, options(args))
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_simulated(report))
    print(format_summary(report["summary"], report.get("cost")))
    print(f"report (simulated): {report['out_dir']}/")
    return 0


def sweep_runner(args):
    """run(cfg) for sweep.run_sweep when --simulate is given, else None (the real runs)."""
    if not getattr(args, "simulate", False):
        return None
    from .run import simulate

    opts = options(args)
    return lambda cfg: simulate(cfg, opts)


def format_simulated(report: dict) -> str:
    s, sim = report["summary"], report["simulation"]
    t = sim["topology"]
    share = sim["time_share_by_term"]
    ranked = sorted(share.items(), key=lambda kv: -abs(kv[1]))
    terms = ", ".join(f"{k} {100 * v:.0f}%" for k, v in ranked if abs(v) >= 0.005)
    return "\n".join([
        f"SIMULATED on {s['hardware']}: {t['world']} devices ({t['nodes']} nodes), tensor {t['tensor']} x data "
        f"{t['data']}, {t['expert_slots']} expert slots; {sim['steps']} steps in {s['simulation_wall_s']:.1f} s "
        "of wall time",
        f"throughput per device / per node: {s['output_tokens_per_s_per_device']:.1f} / "
        f"{s['output_tokens_per_s_per_node']:.1f} output tokens/s; per user p50 "
        f"{s['output_tokens_per_s_per_user_p50']:.1f} tokens/s; input per node "
        f"{s['input_tokens_per_s_per_node']:.1f} tokens/s",
        f"step time by term: {terms}",
    ])
