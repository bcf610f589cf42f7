# The two set-up commands of the README: `make demo` and `make test`.
.PHONY: demo test test-fast bench assets dashboards

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

# The package is the source of truth for the shipped assets: render the dashboards JSON it
# ships from mfotel/dashboards/*.py (needs the dev extra), then regenerate the repository's
# copies in prometheus/, alertmanager/, grafana/ (tests/test_packaging.py fails when they differ).
assets:
	.venv/bin/python -m mfotel.dashboards --out mfotel/dashboards/grafana/dashboards
	.venv/bin/mfotel assets --out .

dashboards: assets
