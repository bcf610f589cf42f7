"""Write the Grafana dashboards as JSON files (checked in under grafana/dashboards/).

    python -m mfotel.dashboards --out grafana/dashboards
    python -m mfotel.dashboards --check           # exit 1 if the checked-in JSON is stale
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from . import cluster, overview, params
from .common import DashboardSpec
from .render import render

DASHBOARDS: tuple[DashboardSpec, ...] = (overview.DASHBOARD, cluster.DASHBOARD,
                                         params.DASHBOARD)

#: Where the checked-in copies live, relative to the repository root.
DEFAULT_OUT = Path("grafana") / "dashboards"


def render_all() -> dict[str, str]:
    """file name -> JSON text of every dashboard."""
    uids = [spec.uid for spec in DASHBOARDS]
    assert len(set(uids)) == len(uids), f"duplicate dashboard uids: {uids}"
    return {spec.filename: render(spec) for spec in DASHBOARDS}


def write_dashboards(out_dir: str | Path) -> list[Path]:
    """Write every dashboard to `out_dir` (created if needed); the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_all().items():
        path = out / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def stale_files(out_dir: str | Path) -> list[str]:
    """Names of dashboards in `out_dir` that differ from a fresh build (or are missing)."""
    out = Path(out_dir)
    return [name for name, text in render_all().items()
            if not (out / name).is_file() or (out / name).read_text(encoding="utf-8") != text]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mfotel dashboards", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT),
                        help="output directory (default: %(default)s)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if the files in --out are stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files(args.out)
        for name in stale:
            print(f"stale: {Path(args.out) / name} (regenerate: mfotel dashboards --out "
                  f"{args.out})", file=sys.stderr)
        return 1 if stale else 0
    for path in write_dashboards(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
