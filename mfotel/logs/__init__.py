"""Tools for monitor log files: parse, summary, CSV export, plots, backfill into Prometheus."""
