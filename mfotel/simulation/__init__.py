"""A large job simulated honestly: many ranks of real mfotel exposition, scripted faults.

Every simulated rank is the real per-rank stack (`Telemetry`, `Instruments`, the cached
exposition, its own HTTP server on a real port); only the training loop is synthetic. A few
worker processes host the ranks; a real Prometheus scrapes them through a file_sd file and
evaluates the rules; Alertmanager routes the alerts; the pages are checked against what each
scripted fault should cause.

    mfotel simulate --ranks 1024 --with-stack            # local Prometheus + Alertmanager
    mfotel simulate --ranks 1024 --with-stack --node-agents   # and a node agent per node
    mfotel simulate --ranks 256 --file-sd-dir /etc/prometheus/targets    # your own stack

Modules: `scenario` (pure: jobs, faults, the training model, expected pages),
`ranks` (a worker process serving simulated ranks), `node_agents` (a node endpoint per
simulated node, as `mfotel-instrument` serves it), `stack` (local Prometheus and
Alertmanager with the shipped configs, their self-measurements), `run` (orchestration, checks,
the command line).
"""
