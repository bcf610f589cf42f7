"""mfotel's test suite: unit/ (fast, no MindSpore training, no external servers), e2e/ (real
MindSpore, msrun, Prometheus, Alertmanager, chromium, packaging) and support/ (their helpers)."""
