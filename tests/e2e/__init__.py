"""End-to-end tests: real MindSpore training, msrun, Prometheus, Alertmanager, chromium,
packaging. Every test here is marked `slow` (tests/e2e/conftest.py)."""
