# The two set-up commands of the README: `make demo` and `make test`.
.PHONY: demo test test-fast lint bench assets dashboards

demo:
	scripts/bootstrap.sh demo
	.venv/bin/mfotel demo

# The suite waits on Prometheus, Alertmanager and whole training jobs, and computes in real
# MindSpore processes: three pytest workers per core keep both cores busy. Measured on 2
# cores: xdist's own order with 3 workers 21.5 min; longest first (tests/support/scheduling.py)
# with 6 workers 12.4 min (~1,060 CPU-seconds, 142% of the 2 cores). More workers overload the
# start, when every worker starts a MindSpore job: 10 workers 10.9 min but 3 tests failed
# (Prometheus answering a query in more than 5 s, false pages of the 32-rank simulation); 8
# workers beside a busy core: the simulation's false pages again. Each test module runs
# on one worker (loadscope), so its module-scoped servers and training runs start once; the
# whole-job tests and the promtool runs are scheduled one by one.
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) * 3 )))
PYTEST_PARALLEL = -n $(TEST_WORKERS) --dist loadscope

test:
	scripts/bootstrap.sh test
	$(MAKE) lint
	.venv/bin/python -m pytest -q $(PYTEST_PARALLEL) --durations=15

# ruff and mypy as configured in pyproject.toml (both from the dev extra: `make test` installs
# them); both report, either failing fails
lint:
	.venv/bin/ruff check mfotel tests benchmarks examples scripts; ruff=$$?; \
	.venv/bin/mypy && exit $$ruff

test-fast:
	.venv/bin/python -m pytest -q $(PYTEST_PARALLEL) -m "not slow"

bench:
	.venv/bin/python benchmarks/run_all.py

# The package is the source of truth for the shipped assets: render the dashboards JSON it
# ships from mfotel/dashboards/*.py (needs the dev extra), then regenerate the repository's
# copies in prometheus/, alertmanager/, grafana/ (tests/e2e/test_packaging.py fails when they
# differ).
assets:
	.venv/bin/python -m mfotel.dashboards --out mfotel/dashboards/grafana/dashboards
	.venv/bin/mfotel assets --out .

dashboards: assets
