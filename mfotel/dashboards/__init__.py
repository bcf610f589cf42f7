"""Grafana dashboards as code: declarative panel modules, one per dashboard.

    from mfotel.dashboards import write_dashboards
    write_dashboards("/tmp/dashboards")     # render from the panel modules (needs the SDK)

Rendering needs grafana-foundation-sdk (a dev dependency); the definitions do not.
"""
from __future__ import annotations

from .build import DASHBOARDS, main, render_all, write_dashboards
from .common import DashboardSpec, Panel, Row, Target
from .queries import PanelQuery, dashboard_queries, metric_names, substitute, with_rank_lines_limit

__all__ = ["DASHBOARDS", "DashboardSpec", "Panel", "PanelQuery", "Row", "Target",
           "dashboard_queries", "main", "metric_names", "render_all", "substitute",
           "with_rank_lines_limit", "write_dashboards"]
