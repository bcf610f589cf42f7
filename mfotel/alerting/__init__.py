"""Paging: alerting and recording rules generated from Python, the webhook receiver, and the
fast path that posts a NaN-loss alert straight to Alertmanager."""
