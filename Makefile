# The two set-up commands of the README: `make demo` and `make test`.
.PHONY: demo test test-fast bench dashboards

demo:
	scripts/bootstrap.sh demo
	.venv/bin/mfotel demo

test:
	scripts/bootstrap.sh test
	.venv/bin/python -m pytest -q

test-fast:
	.venv/bin/python -m pytest -q -m "not slow"

bench:
	.venv/bin/python benchmarks/run_all.py

dashboards:
	.venv/bin/mfotel dashboards --out grafana/dashboards
