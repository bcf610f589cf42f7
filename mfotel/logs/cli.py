"""`mfotel plot | export | backfill | summary | goodput`: commands over monitor logs.

    add_log_commands(subparsers)     # from mfotel.cli.build_parser

Each RUN is a monitor log file (mfotel text or JSON lines, mindformers info.log) or a
directory holding them (recognised by content). Unparseable monitor lines are reported on
stderr with their line numbers; `--strict` turns them into exit code 1. Files that cannot be
read or written are one-line errors (exit 1), never tracebacks.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

from ..closed_pipe import closed_std_streams, quiet_on_closed_pipe
from .parse import (
    MAX_TIME,
    SOURCES,
    ParseReport,
    Progress,
    Row,
    Run,
    discover_runs,
    iter_rows,
    line_job_names,
)

EXIT_OK, EXIT_ERROR = 0, 1


# --- shared plumbing -----------------------------------------------------------------------

def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN",
                        help="monitor log file or directory "
                             "(mfotel text/JSON, mindformers info.log)")
    parser.add_argument("--name", action="append", default=[], metavar="NAME",
                        help="name of the n-th RUN (repeatable; default: directory or file name)")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 when a monitor line cannot be parsed")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no notes")


PROGRESS_DELAY = 0.5   # seconds before a bar appears: quick parses stay quiet


@contextmanager
def _progress(runs: list[Run], quiet: bool) -> Iterator[Progress | None]:
    """A tqdm bar over the bytes of all files, when tqdm is installed and stderr is a TTY;
    it shows only when parsing takes longer than PROGRESS_DELAY."""
    if quiet or not sys.stderr.isatty():
        yield None
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield None
        return
    total = sum(run.total_bytes() for run in runs)
    with tqdm(total=total, unit="B", unit_scale=True, desc="parsing", leave=False,
              file=sys.stderr, delay=PROGRESS_DELAY) as bar:
        yield bar.update


def _finish(report: ParseReport, args: argparse.Namespace) -> int:
    if report.problem_count:
        print(f"mfotel: warning: {report.describe()}", file=sys.stderr)
        if args.strict:
            return EXIT_ERROR
    elif not args.quiet:
        print(f"mfotel: {report.describe()}", file=sys.stderr)
    return EXIT_OK


def _runs(args: argparse.Namespace) -> list[Run]:
    return discover_runs(args.runs, args.name)


def _error(message: str) -> int:
    print(f"mfotel: error: {message}", file=sys.stderr)
    return EXIT_ERROR


def _file_errors_are_messages(command: Callable[[argparse.Namespace], int]
                              ) -> Callable[[argparse.Namespace], int]:
    """A RUN that does not exist, a log that cannot be read, an output that cannot be
    written: a one-line error naming the file, not a traceback."""
    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except FileNotFoundError as exc:
            return _error(str(exc) if exc.filename is None
                          else f"{exc.filename}: {exc.strerror or exc}")
        except OSError as exc:
            if isinstance(exc, BrokenPipeError) and closed_std_streams():
                raise       # the reader of our output left: the entry point ends quietly
            where = f"{exc.filename}: " if exc.filename else ""
            return _error(f"{where}{exc.strerror or exc}")
    return run


# --- commands ------------------------------------------------------------------------------

def cmd_plot(args: argparse.Namespace) -> int:
    """Loss, learning rate, grad norm, throughput and step time curves, runs overlaid."""
    from . import plot
    try:
        out = plot.output_path(args.output)     # before the parse, which may take a while
    except ValueError as exc:
        return _error(str(exc))
    runs = _runs(args)
    report = ParseReport()
    with _progress(runs, args.quiet) as progress:
        series = plot.collect(iter_rows(runs, report, progress),
                              ranks=set(args.rank) if args.rank else None)
    if not series:
        _finish(report, args)
        return _error("no training steps found in " + ", ".join(args.runs))
    try:
        figure = plot.build_figure(series, smooth=args.smooth, log_scale=args.log_scale,
                                   title=args.title, auto_log=not args.linear)
    except ValueError as exc:
        return _error(str(exc))
    out = plot.save(figure, out, dpi=args.dpi)
    status = _finish(report, args)
    if not args.quiet:
        print(f"mfotel: wrote {out}", file=sys.stderr)
    return status


def cmd_export(args: argparse.Namespace) -> int:
    """Tidy CSV: run, rank, step, epoch, time and the metric values."""
    from .export import write_csv
    runs = _runs(args)
    report = ParseReport()
    with _progress(runs, args.quiet) as progress:
        if args.csv == "-":
            count = write_csv(iter_rows(runs, report, progress), sys.stdout)
        else:
            out = Path(args.csv)
            out.parent.mkdir(parents=True, exist_ok=True)
            with open(out, "w", encoding="utf-8", newline="") as handle:
                count = write_csv(iter_rows(runs, report, progress), handle)
    status = _finish(report, args)
    if not args.quiet and args.csv != "-":
        print(f"mfotel: wrote {count} rows to {args.csv}", file=sys.stderr)
    return status


def parse_time(text: str) -> float:
    """Unix seconds from `1764671400`, `2025-12-02T10:30:00Z` or `2025-12-02 10:30:00+08:00`
    (no zone: local time)."""
    try:
        seconds = float(text)
    except ValueError:
        try:
            seconds = datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
        except (ValueError, OverflowError, OSError):
            raise argparse.ArgumentTypeError(
                f"{text!r} is neither unix seconds nor an ISO 8601 time") from None
    if not (math.isfinite(seconds) and 0.0 <= seconds <= MAX_TIME):
        raise argparse.ArgumentTypeError(f"{text!r} is outside the years 1970..9999")
    return seconds


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def cmd_backfill(args: argparse.Namespace) -> int:
    """OpenMetrics with the live names and labels; optionally TSDB blocks via promtool."""
    from .backfill import (
        JOB_FROM_LINES,
        JOB_FROM_OPTION,
        JOB_FROM_RUN,
        BackfillError,
        create_blocks,
        find_promtool,
        write_openmetrics,
    )
    runs = _runs(args)
    if args.job_name and len(args.job_name) != len(runs):
        return _error(f"give one --job-name per RUN ({len(runs)}), or none to use the run names")
    if args.create_blocks and find_promtool() is None:
        return _error("--create-blocks needs promtool on PATH (apt-get install prometheus)")
    forced = dict(zip((r.name for r in runs), args.job_name, strict=False))  # --job-name
    # lines without a job_name (text, info.log) join the job their run's JSON lines name
    of_run = {run.name: names.pop() for run in runs
              if run.name not in forced and len(names := line_job_names(run)) == 1}
    out_dir = Path(args.out)
    om_path = out_dir / args.file_name
    report = ParseReport()
    try:
        with _progress(runs, args.quiet) as progress:
            rows: Iterator[Row] = iter_rows(runs, report, progress)
            if args.source:
                rows = (row for row in rows if row.source in args.source)
            stats = write_openmetrics(rows, om_path, job_names=forced, start=args.start,
                                      step_seconds=args.step_seconds, run_job_names=of_run)
    except BackfillError as exc:
        return _error(str(exc))
    status = _finish(report, args)
    if stats.rows == 0:
        return _error("no training steps found in " + ", ".join(args.runs))
    for (run_name, job_name), origin in sorted(stats.job_names.items()):
        how = {JOB_FROM_OPTION: "given by --job-name",
               JOB_FROM_LINES: "the job_name its JSON lines carry",
               JOB_FROM_RUN: "the run's name: its lines carry no job_name (--job-name NAME "
                             "to choose one)"}[origin]
        print(f"mfotel: run {run_name}: job_name {job_name} ({how})", file=sys.stderr)
    for job_name, rank, source, count in stats.left_out:
        print(f"mfotel: note: job_name {job_name} rank {rank}: backfilled from "
              f"{stats.sources[(job_name, rank)]}; left out its {count} {source} step(s) "
              f"(--source {source} to backfill those instead)", file=sys.stderr)
    if stats.skipped_out_of_order:
        print(f"mfotel: warning: skipped {stats.skipped_out_of_order} row(s) whose time was not "
              f"after the previous row of the same job_name and rank", file=sys.stderr)
    span = f"{_iso(stats.min_time)} .. {_iso(stats.max_time)}"
    print(f"mfotel: wrote {stats.samples} samples of {len(stats.series)} job/rank series "
          f"({stats.rows} steps, {span}) to {om_path}", file=sys.stderr)
    if args.create_blocks:
        data_dir = out_dir / "data"
        try:
            output = create_blocks(om_path, data_dir)
        except (RuntimeError, OSError) as exc:
            return _error(str(exc))
        if not args.quiet:
            print(output.rstrip(), file=sys.stderr)
        age_days = (time.time() - (stats.min_time or time.time())) / 86400
        retention = f"{math.ceil(age_days) + 30}d" if age_days > 14 else "15d"
        print(f"mfotel: TSDB blocks in {data_dir}; serve them with\n"
              f"  prometheus --storage.tsdb.path={data_dir} "
              f"--storage.tsdb.retention.time={retention}\n"
              f"or move the block directories into a Prometheus data dir (not for the last 3 "
              f"hours: that is the live head block; data older than the retention time is "
              f"deleted at startup).", file=sys.stderr)
    else:
        print(f"mfotel: to make TSDB blocks: promtool tsdb create-blocks-from openmetrics "
              f"{om_path} {out_dir / 'data'}", file=sys.stderr)
    return status


def _iso(seconds: float | None) -> str:
    return "-" if seconds is None else datetime.fromtimestamp(seconds).isoformat(timespec="seconds")


def cmd_summary(args: argparse.Namespace) -> int:
    """A Markdown table per run."""
    from .summary import summarize_markdown
    runs = _runs(args)
    report = ParseReport()
    with _progress(runs, args.quiet) as progress:
        text = summarize_markdown(runs, report, progress)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return _finish(report, args)


def cmd_goodput(args: argparse.Namespace) -> int:
    """One run's goodput account over the monitor logs of all its attempts."""
    from .goodput import account_json, format_account, marks_from_rows, run_account
    runs = _runs(args)
    report = ParseReport()
    with _progress(runs, args.quiet) as progress:
        marks = marks_from_rows(iter_rows(runs, report, progress))
    if not marks:
        _finish(report, args)
        return _error("no monitor line in " + ", ".join(args.runs) + " carries the time "
                      "account (account_* fields, written by ranks whose time account is on)")
    account = run_account(marks)
    if args.json:
        sys.stdout.write(json.dumps(account_json(account), indent=2) + "\n")
    else:
        sys.stdout.write(format_account(account))
    return _finish(report, args)


# --- registration --------------------------------------------------------------------------

def _smooth(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"smoothing weight must be a number, got {text!r}"
                                         ) from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"smoothing weight must be in [0, 1), got {text}")
    return value


def add_log_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register plot, export, backfill, summary and goodput; each sets `func(args) -> exit
    code`."""
    plot = subparsers.add_parser(
        "plot", help="draw loss, lr, grad norm, throughput and step time curves of runs",
        description="Draw loss, learning rate, grad norm, throughput and step time of one or "
                    "more runs (overlaid, with a legend; each series its own colour and dash "
                    "pattern). NaN/Inf steps are marked with x. The loss and step-time axes are "
                    "logarithmic when their values span a decade or more.")
    _common(plot)
    plot.add_argument("-o", "--output", default="curves.png",
                      help="image file; format from the extension (.png default, .svg, .pdf, "
                           "...)")
    plot.add_argument("--smooth", type=_smooth, default=None, metavar="W",
                      help="also draw an exponential moving average with weight W in [0, 1), "
                           "e.g. 0.9")
    plot.add_argument("--log-scale", action="store_true",
                      help="logarithmic y axis on every panel (loss, learning rate, grad norm, "
                           "throughput, step time)")
    plot.add_argument("--linear", action="store_true",
                      help="linear loss and step-time axes even when their values span a "
                           "decade or more")
    plot.add_argument("--rank", type=int, action="append", default=[],
                      help="only this rank (repeatable; default: all)")
    plot.add_argument("--title", default=None)
    plot.add_argument("--dpi", type=int, default=120)
    plot.set_defaults(func=_file_errors_are_messages(cmd_plot))

    export = subparsers.add_parser(
        "export", help="write runs as a tidy CSV",
        description="One CSV line per (run, rank, step): run, rank, step, epoch, time, loss, "
                    "learning_rate, grad_norm, throughput, step_time, loss_scale.")
    _common(export)
    export.add_argument("--csv", required=True, metavar="PATH", help="output CSV ('-' = stdout)")
    export.set_defaults(func=_file_errors_are_messages(cmd_export))

    backfill = subparsers.add_parser(
        "backfill", help="write runs as OpenMetrics for Prometheus (promtool backfill)",
        description="Write OUT/backfill.om with the live metric names and labels "
                    "(mindformers_train_loss{job_name,rank}, ...), one sample per logged step; "
                    "with --create-blocks also run promtool to make TSDB blocks in OUT/data.")
    _common(backfill)
    backfill.add_argument("--out", required=True, metavar="DIR", help="output directory")
    backfill.add_argument("--file-name", default="backfill.om", help=argparse.SUPPRESS)
    backfill.add_argument("--job-name", action="append", default=[],
                          help="job_name label of the n-th RUN (repeatable; default: the "
                               "job_name its JSON lines carry, else the run name)")
    backfill.add_argument("--start", type=parse_time, default=None,
                          help="time of step 0 for rows without a timestamp (text lines of "
                               "older mfotel versions): unix seconds or ISO 8601")
    backfill.add_argument("--step-seconds", type=_positive, default=1.0,
                          help="seconds per step for rows without a timestamp (default 1)")
    backfill.add_argument("--source", action="append", choices=SOURCES, default=[],
                          help="only rows of this source (repeatable); default: per job_name "
                               "and rank the first present of " + ", ".join(SOURCES))
    backfill.add_argument("--create-blocks", action="store_true",
                          help="run promtool tsdb create-blocks-from openmetrics into OUT/data")
    backfill.set_defaults(func=_file_errors_are_messages(cmd_backfill))

    summary = subparsers.add_parser(
        "summary", help="Markdown summary table per run",
        description="Per run: logs, config, and per rank the steps, first/last/min loss, first "
                    "non-finite step with the lr and grad norm before it, mean throughput.")
    _common(summary)
    summary.add_argument("-o", "--output", default=None, help="write to this file, not stdout")
    summary.set_defaults(func=_file_errors_are_messages(cmd_summary))

    goodput = subparsers.add_parser(
        "goodput", help="a run's goodput account from the monitor logs of all its attempts",
        description="Where a run's time went, across its attempts: goodput (the steps that "
                    "count, each once) and start-up, input, checkpoint, evaluation, stall, "
                    "downtime between attempts, recomputed steps and unaccounted time, from the "
                    "time account of the monitor lines (account_* fields). Every RUN is read as "
                    "part of one run: give the logs of all its attempts; ranks are averaged.")
    _common(goodput)
    goodput.add_argument("--json", action="store_true", help="print the account as JSON")
    goodput.set_defaults(func=_file_errors_are_messages(cmd_goodput))


@quiet_on_closed_pipe
def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m mfotel.logs.cli plot ...`) until mfotel.cli wires it."""
    parser = argparse.ArgumentParser(prog="mfotel")
    add_log_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
