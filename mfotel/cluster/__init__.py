"""Many ranks, one job: Prometheus service discovery (file_sd, `mfotel targets`) and OTLP push."""
