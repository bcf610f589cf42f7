"""`mfotel` command line: check, demo, and the tools of the other modules."""
from __future__ import annotations

import argparse
import sys
import urllib.request
from typing import Any, Sequence

import yaml

from .alerting.receiver import add_alerts_receiver_command
from .config import ConfigError, describe, load_config, read_yaml
from .actions.control import add_control_command
from .cluster.discovery import add_targets_command
from .cluster.simulation.run import add_simulate_command
from .contract import SEED_METRICS
from .logs.cli import add_log_commands
from .alerting.rules import add_rules_command


def _is_mindformers_yaml(path: str) -> bool:
    try:
        document = read_yaml(path)
    except ConfigError:
        return False
    return isinstance(document, dict) and any(
        k in document for k in ("callbacks", "runner_wrapper", "context", "model", "trainer"))


def cmd_check(args: argparse.Namespace) -> int:
    """Validate a training YAML's monitor settings; print the resolved values."""
    status = 0
    for path in args.config:
        if _is_mindformers_yaml(path):
            from .integrations.mindformers_check import check_mindformers_yaml
            problems = check_mindformers_yaml(
                path, use_mindformers=False if args.no_mindformers else None)
            for problem in problems:
                print(f"error: {problem}", file=sys.stderr)
            if problems:
                status = 2
                continue
        try:
            cfg = load_config(path)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            status = 2
            continue
        print(f"# {path}: OK")
        print(yaml.safe_dump({"monitor_config": describe(cfg)}, sort_keys=False).rstrip())
    return status


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
    print(f"mfotel demo: {args.steps} steps, metrics on http://{args.host}:{args.port}/metrics "
          f"(job_name={args.job_name})", flush=True)
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


def cmd_dashboards(args: argparse.Namespace) -> int:
    """Regenerate the Grafana dashboards (or --check that the checked-in ones are current)."""
    from .dashboards.build import main as build_main
    return build_main(["--out", args.out] + (["--check"] if args.check else []))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mfotel", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check", help="validate monitor_config in training YAML files")
    check.add_argument("config", nargs="+", help="training YAML file(s)")
    check.add_argument("--no-mindformers", action="store_true",
                       help="check a mindformers YAML without importing mindformers (faster)")
    check.set_defaults(func=cmd_check)

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
    add_rules_command(sub)
    add_alerts_receiver_command(sub)
    add_log_commands(sub)
    add_control_command(sub)
    add_targets_command(sub)
    add_simulate_command(sub)

    dashboards = sub.add_parser("dashboards", help="generate the Grafana dashboards JSON")
    dashboards.add_argument("--out", default="grafana/dashboards")
    dashboards.add_argument("--check", action="store_true", help="exit 1 if the files are stale")
    dashboards.set_defaults(func=cmd_dashboards)
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
