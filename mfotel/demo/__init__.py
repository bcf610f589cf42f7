"""The demo: a tiny real MindSpore training, alone or paging through the local Prometheus +
Alertmanager stack (mfotel.localstack)."""
