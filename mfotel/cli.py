"""`mfotel` command line: check, demo, the shipped assets, and the tools of the other modules."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import yaml

from . import __version__
from .actions.control import add_control_command
from .alerting.receiver import add_alerts_receiver_command
from .assets import add_asset_commands
from .checks import check_file
from .closed_pipe import quiet_on_closed_pipe
from .cluster.discovery import add_targets_command
from .config import ConfigError, describe, json_schema
from .config.preflight import FIRST_UNPRIVILEGED_PORT, MAX_PORT
from .contract import SEED_METRICS
from .integrations.mindformers_check import document_check
from .logs.cli import add_log_commands
from .simulation.run import add_simulate_command

#: --ranks-per-node's bound: each rank of a node serves its own port above the privileged ones.
MAX_RANKS_PER_NODE = MAX_PORT - FIRST_UNPRIVILEGED_PORT + 1


def ranks_per_node_arg(text: str) -> int:
    """--ranks-per-node: a whole number of ranks one node runs, each serving a port."""
    try:
        count = int(text)
    except ValueError:
        count = 0
    if not 1 <= count <= MAX_RANKS_PER_NODE:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of ranks on one node between 1 and {MAX_RANKS_PER_NODE} "
            f"(each serves its own port); give the ranks of ONE node, e.g. 8")
    return count


def cmd_check(args: argparse.Namespace) -> int:
    """Report every problem of each training YAML (exit 2); print the effective settings."""
    status = 0
    mindformers = document_check(use_mindformers=False if args.no_mindformers else None)
    for path in args.config:
        report = check_file(path, ranks=args.ranks_per_node, world_size=args.world_size,
                            document_check=mindformers)
        for line in report.errors:
            print(f"error: {line}", file=sys.stderr)
        for line in report.warnings:
            print(f"warning: {line}", file=sys.stderr)
        if report.errors:
            status = 2
            print(f"# {path}: {len(report.errors)} error(s)", file=sys.stderr)
            continue
        print(f"# {path}: OK")
        for line in report.notes:
            print(f"# {line}")
        for key, variable in report.sources.items():
            print(f"# {key}: from {variable}")
        assert report.config is not None  # without errors, the settings were read
        key = "monitor_config" if report.where == "monitor_config" else \
            f"{report.where} (type: OTelMonitor)"
        print(yaml.safe_dump({key: describe(report.config)}, sort_keys=False,
                             allow_unicode=True).rstrip())
    return status


def cmd_schema(args: argparse.Namespace) -> int:
    """Print the JSON Schema of monitor_config (for editors and CI)."""
    text = json.dumps(json_schema(args.kind), indent=2) + "\n"
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text)
    else:
        sys.stdout.write(text)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Train a tiny real network on the CPU with the monitor on and /metrics served."""
    if args.with_alerting:
        return _alerting_demo(args)
    from .demo.command import demo_command
    overrides: dict[str, Any] = {"metrics": args.metrics, "on_nonfinite": args.on_nonfinite,
                                 "log_rank": args.log_rank}
    if args.seq_length:
        overrides["seq_length"] = args.seq_length
    if args.file_path:
        overrides["output"] = {"console": True, "file": True, "file_path": args.file_path,
                               "format": args.format}
    return demo_command(args, overrides)


def _alerting_demo(args: argparse.Namespace) -> int:
    """The demo plus real Prometheus + Alertmanager + receiver on loopback, and a NaN."""
    from .demo.alerting import run_alerting_demo
    try:
        run_alerting_demo(steps=min(args.steps, 200), nan_at_step=args.nan_at_step or 20,
                          port=args.port or None, job_name=args.job_name)
    except (RuntimeError, FileNotFoundError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mfotel", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check", help="report every problem of the monitor settings in "
                                         "training YAML files (exit 2)")
    check.add_argument("config", nargs="+", help="training YAML file(s)")
    check.add_argument("--no-mindformers", action="store_true",
                       help="check a mindformers YAML without importing mindformers (faster)")
    check.add_argument("--ranks-per-node", type=ranks_per_node_arg, default=None,
                       help="ranks on one node, for the port plan (default: the launcher's "
                            "LOCAL_WORLD_SIZE, else 8)")
    check.add_argument("--world-size", type=int, default=None,
                       help="ranks of the job, checked against file_sd.hosts")
    check.set_defaults(func=cmd_check)

    schema = sub.add_parser("schema", help="print the JSON Schema (draft 2020-12) of "
                                           "monitor_config, for editors")
    schema.add_argument("--kind", choices=("plain", "mindformers", "block"), default="plain",
                        help="plain: a YAML with a monitor_config block; mindformers: the "
                             "OTelMonitor callback entry; block: the mapping alone")
    schema.add_argument("--out", default=None, help="write to this file instead of stdout")
    schema.set_defaults(func=cmd_schema)

    demo = sub.add_parser("demo", help="train a tiny MindSpore network on the CPU with metrics")
    demo.add_argument("--steps", type=int, default=400)
    demo.add_argument("--step-interval", type=int, default=20)
    demo.add_argument("--host", default="127.0.0.1", help="bind address of /metrics")
    demo.add_argument("--port", type=int, default=9464, help="/metrics port (0 = off)")
    demo.add_argument("--job-name", default="mfotel-demo")
    demo.add_argument("--nan-at-step", type=int, default=None, help="inject a NaN loss at step K")
    demo.add_argument("--on-nonfinite", choices=("warn", "stop"), default="warn")
    demo.add_argument("--linger-seconds", type=float, default=0.0,
                      help="keep /metrics up this long after the end")
    demo.add_argument("--batch-size", type=int, default=8)
    demo.add_argument("--seq-length", type=int, default=None,
                      help="tokens per sample, enables mindformers_train_tokens_total")
    demo.add_argument("--lr-schedule", choices=("constant", "list", "cosine"), default="cosine")
    demo.add_argument("--step-sleep", type=float, default=0.05,
                      help="extra seconds per step, so the run lasts long enough to watch")
    demo.add_argument("--metrics", nargs="+", choices=SEED_METRICS, default=list(SEED_METRICS))
    demo.add_argument("--log-rank", type=int, default=0)
    demo.add_argument("--file-path", default=None, help="also write monitor lines to this file")
    demo.add_argument("--format", choices=("text", "json"), default="text")
    demo.add_argument("--with-alerting", action="store_true",
                      help="also run Prometheus, Alertmanager and a receiver on loopback, inject "
                           "a NaN and show the page arriving")
    demo.set_defaults(func=cmd_demo)
    add_asset_commands(sub)   # rules, dashboards, alertmanager-config, assets
    add_alerts_receiver_command(sub)
    add_log_commands(sub)
    add_control_command(sub)
    add_targets_command(sub)
    add_simulate_command(sub)

    return parser


@quiet_on_closed_pipe
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
