"""The demo: a tiny real MindSpore training, and a local Prometheus + Alertmanager stack."""
