"""Render the Grafana dashboards from the panel modules (a dev tool: needs grafana-foundation-sdk).

The rendered JSON is shipped as package data (`mfotel/dashboards/grafana/dashboards/`), which
`mfotel dashboards --out DIR` copies without the SDK. After editing a panel module:

    python -m mfotel.dashboards --out mfotel/dashboards/grafana/dashboards   # or: make assets
    python -m mfotel.dashboards --out mfotel/dashboards/grafana/dashboards --check
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from . import cluster, overview, params
from .common import DashboardSpec
from .render import render

DASHBOARDS: tuple[DashboardSpec, ...] = (overview.DASHBOARD, cluster.DASHBOARD,
                                         params.DASHBOARD)

#: Where the package keeps the rendered JSON (package data, relative to the checkout).
PACKAGE_DATA = Path("mfotel") / "dashboards" / "grafana" / "dashboards"


def render_all() -> dict[str, str]:
    """file name -> JSON text of every dashboard."""
    uids = [spec.uid for spec in DASHBOARDS]
    assert len(set(uids)) == len(uids), f"duplicate dashboard uids: {uids}"
    return {spec.filename: render(spec) for spec in DASHBOARDS}


def _rendered() -> dict[str, bytes]:
    return {name: text.encode("utf-8") for name, text in render_all().items()}


def write_dashboards(out_dir: str | Path) -> list[Path]:
    """Render every dashboard into `out_dir` (created if needed); the paths written."""
    from ..assets import write_files
    return write_files(_rendered(), out_dir)


def stale_files(out_dir: str | Path) -> list[str]:
    """Names of dashboards in `out_dir` that differ from a fresh build (or are missing)."""
    from ..assets import stale_files as stale
    return stale(_rendered(), out_dir)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mfotel.dashboards",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, metavar="DIR",
                        help=f"output directory (the package's copy: {PACKAGE_DATA})")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if the files in --out are stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files(args.out)
        for name in stale:
            print(f"stale: {Path(args.out) / name} (regenerate: python -m mfotel.dashboards "
                  f"--out {args.out})", file=sys.stderr)
        return 1 if stale else 0
    for path in write_dashboards(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
