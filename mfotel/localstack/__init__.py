"""The real Prometheus and Alertmanager binaries on loopback, each with its own data directory
and a free port (clustering off): what `mfotel demo --with-alerting`, `mfotel simulate`,
`mfotel backfill` and the tests run. Importing this package imports nothing.

    servers.py    free ports, finding binaries, Prometheus and Alertmanager processes
    alerting.py   the shipped configs as an operator wires them, with a receiver (AlertingStack)
"""
