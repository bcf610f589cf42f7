"""Many ranks, one job: Prometheus service discovery (file_sd, `mfotel targets`), multi-rank
set-up at train begin and OTLP push."""
