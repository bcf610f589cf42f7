"""`mfotel` command line: check, demo, the shipped assets, and the tools of the other modules."""
from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from typing import Any, Sequence

import yaml

from . import __version__
from .alerting.receiver import add_alerts_receiver_command
from .assets import add_asset_commands
from .config import ConfigError, describe, json_schema
from .actions.control import add_control_command
from .cluster.discovery import add_targets_command
from .cluster.simulation.run import add_simulate_command
from .contract import SEED_METRICS
from .logs.cli import add_log_commands


def cmd_check(args: argparse.Namespace) -> int:
    """Report every problem of each training YAML (exit 2); print the effective settings."""
    from .config.check import check_file
    status = 0
    for path in args.config:
        report = check_file(path, ranks_per_node=args.ranks_per_node, world_size=args.world_size,
                            use_mindformers=False if args.no_mindformers else None)
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


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def cmd_demo(args: argparse.Namespace) -> int:
    """Train a tiny real network on the CPU with the monitor on and /metrics served."""
    if args.with_alerting:
        return _alerting_demo(args)
    from .demo.training import run_demo
    overrides: dict[str, Any] = {"metrics": args.metrics, "on_nonfinite": args.on_nonfinite,
                                 "log_rank": args.log_rank}
    if args.seq_length:
        overrides["seq_length"] = args.seq_length
    if args.file_path:
        overrides["output"] = {"console": True, "file": True, "file_path": args.file_path,
                               "format": args.format}
    excerpt: list[str] = []
    host = "127.0.0.1" if args.host in ("0.0.0.0", "") else args.host
    print(f"mfotel demo: {args.steps} steps, metrics on http://{host}:{args.port}/metrics "
          f"(job_name={args.job_name})", flush=True)
    if args.port:
        print(f"mfotel demo: live page on http://{host}:{args.port}/ (open it in a browser; "
              f"--linger-seconds N keeps it up N s after the last step)", flush=True)
    result = run_demo(steps=args.steps, step_interval=args.step_interval, port=args.port,
                      nan_at_step=args.nan_at_step, job_name=args.job_name,
                      linger_seconds=args.linger_seconds, batch_size=args.batch_size,
                      lr_schedule=args.lr_schedule, min_step_seconds=args.step_sleep,
                      extra_callbacks=(_LastScrape(excerpt, args.port),) if args.port else (),
                      prometheus={"host": args.host, "port": args.port,
                                  "linger_seconds": args.linger_seconds},
                      **overrides)
    print(f"mfotel demo: trained {len(result.losses)} steps in {result.seconds:.1f} s; "
          f"last loss {result.losses[max(result.losses)]:.6g}")
    if excerpt:
        print("mfotel demo: /metrics at the last step (excerpt):")
        print("\n".join(excerpt))
    return 0


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


class _LastScrape:
    """Scrapes this process's own endpoint after the last step, to show what Prometheus sees."""

    def __new__(cls, sink: list[str], port: int) -> Any:
        from mindspore.train import Callback

        class LastScrape(Callback):
            def on_train_step_end(self, run_context: Any) -> None:
                cb = run_context.original_args()
                if cb.cur_step_num != cb.epoch_num * cb.batch_num:
                    return
                try:
                    body = _scrape(f"http://127.0.0.1:{port}/metrics")
                except OSError as exc:
                    sink.append(f"  (scrape failed: {exc})")
                    return
                sink.extend("  " + line for line in body.splitlines()
                            if line.startswith("mindformers_train_") and "_bucket" not in line)
        return LastScrape()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mfotel", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check", help="report every problem of the monitor settings in "
                                         "training YAML files (exit 2)")
    check.add_argument("config", nargs="+", help="training YAML file(s)")
    check.add_argument("--no-mindformers", action="store_true",
                       help="check a mindformers YAML without importing mindformers (faster)")
    check.add_argument("--ranks-per-node", type=int, default=None,
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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
