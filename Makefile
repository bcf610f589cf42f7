# The two set-up commands of the README: `make demo` and `make test`.
.PHONY: demo test test-fast lint bench assets dashboards

demo:
	scripts/bootstrap.sh demo
	.venv/bin/mfotel demo

# The suite waits on Prometheus, Alertmanager and whole training jobs, and computes in real
# MindSpore processes. Measured on 2 cores (pytest alone): xdist's own order with 3 workers
# 21.5 min; longest first with 6 workers 10.5 min, the cores 78% busy for the first 3.5 min
# (every worker waiting on a whole-job test); with at most 6 whole-job tests at once and short
# work queued behind them (tests/support/scheduling.py), 8 workers 8.0 min, 10 workers 7.2 min
# (the cores then saturated: more would not help); with the cascade tests (real msrun jobs
# waiting out MindSpore's time-outs, one of 300 s) 10 workers took 14.5 min, ~1,300 CPU-s
# (2026-12-06); the whole-job tests longest first and short work queued behind them, with the
# goodput and sharded whole-job tests added, 12.1 min, ~1,140 CPU-s (the cores then ~80% busy:
# 8 min needs ~900 CPU-s); with the long time-out 120 s (from 300), 8 whole-job tests at once
# and 12 workers, 11.1 min, ~1,120 CPU-s, the cores 84% busy: the suite is now bound by its CPU
# (1,120 CPU-s on 2 cores is 9.3 min at best); with the whole-job tests' teardown no longer
# waiting out the ranks' 30 s linger, promtool at GOGC=800 and the tests' Go servers at
# GOGC=400, a fresh clone took 11.4-11.7 min, ~1,150-1,180 CPU-s with the install (the whole-job
# tests' waiting fell by ~500 s, but the CPU bounds the suite); the same suite later the same
# day on the same machine: 12.6-14.1 min, 1,370-1,620 CPU-s (the host's share of the cores
# varies: promtool over every rule test file took 40 s alone and more than 300 s in a run).
# 2026-12-07: 11.9-13.1 min, 1,270-1,430 CPU-s; `benchmarks/suite_cpu.py` prints where the CPU goes
# (MindSpore job processes ~36%, xdist workers 16%, promtool ~11%, Prometheus 11%). Later that
# day, each promtool test with only the rules it reads (tests/support/promtool_split.py):
# promtool 217 -> 63 CPU-s, but the host was slower: 14.0-15.7 min, 1,510-1,780 CPU-s.
# Later still (a slower host: importing MindSpore 3.5-3.9 CPU-s, not 2.8; a load average of
# 17-24, every process ~10x slower than alone): 17-23 min, 1,940-2,670 CPU-s (one run 30.6
# min: a failing test waited out its 1,291 s time-out).
# 2026-12-07 later, fresh clones with the CPU kept: 12 workers 16.8 and 17.0 min (pytest 15.7
# and 16.0), 1,940 CPU-s, a load average of 20-38, 2 and 3 tests failing under it; 8 workers
# 18.3 min (pytest 17.2), 1,990 CPU-s, load 8-12, green; 10 workers 17.6 min (pytest 15.7),
# 1,900 CPU-s, load 9-24, 1 failing. The CPU is the same at any count (ranks step faster when
# less loaded): 10 workers, 5 a core, keep the time and halve the load the tests' waits face.
# 2026-12-07, a new host (CI's took 15.1 min, pytest 904 s): fresh clones 15.0, 14.1, 13.3 and
# 12.9 min (pytest 14.0, 13.2, 12.6, 12.2), 1,700, 1,600, 1,350 and 1,350 CPU-s. Later
# (CI's 15.6 min, pytest 888 s): 14.0 min (pytest 13.2), 1,356 CPU-s, green. 2026-12-07 evening
# (CI's 13.75 min, pytest 782 s): fresh clones 13.1, 13.1 and 13.4 min (pytest 12.3-12.7),
# 1,270-1,365 CPU-s, green. Night, with the spike baselines read from records and the bytecode
# compiled lazily (set-up and lint 53 -> 31-37 s): 14.25, 14.25 and 13.7 min (pytest 818, 825
# and 790 s), 1,374-1,443 CPU-s (importing MindSpore 2.13-2.51 CPU-s), green; the floors of the
# wall (benchmarks/suite_cpu.py) 687-721 s for the CPU over 2 cores and 668-674 s for the
# whole-job tests, 6 at once: 8 minutes needs both cut by about 40%. 2026-12-07 night, with the
# doubled-target promtool run added (~12 CPU-s): 12.7 min (pytest 735 s), 1,239 CPU-s, green;
# floors 620 s (CPU) and 648 s (whole-job tests). 2026-12-08 (CI's 12.2 min, pytest 703 s),
# with the rule-health and OOM tests added: 14.2 min (pytest 810 s), 1,343 CPU-s, green; floors
# 671 s (CPU) and 663 s (whole-job tests).
# Each test module
# runs on one worker (loadscope), so its module-scoped servers and training runs start once;
# the whole-job tests and the promtool runs are scheduled one by one.
# Memory bounds it too: at 10 workers the machine used at most 8.3 GB (MindSpore in every worker
# and in every process of the jobs), so at most one worker per GiB available.
TEST_WORKERS ?= $(shell cores=$$(nproc); \
    mem=$$(awk '/^MemAvailable:/ {print int($$2 / 1048576)}' /proc/meminfo); \
    w=$$(( cores * 5 < mem ? cores * 5 : mem )); echo $$(( w < 1 ? 1 : w )))
PYTEST_PARALLEL = -n $(TEST_WORKERS) --dist loadscope

# Every worker collects the suite; pytest's rewrite of the tests' asserts is half of it (~4
# CPU-s a worker). One collection first, beside lint, writes pytest's cache of rewritten modules
# and the bytecode of what collecting imports (MindSpore), which the workers read. The suite
# runs without PYTHONDONTWRITEBYTECODE (set here): each module it imports is compiled once, by
# the first process to import it (scripts/bootstrap.sh compiles nothing up front for `make
# test`). The collection's errors, if any, are the suite's own to report.
test:
	scripts/bootstrap.sh test
	env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -m pytest -q --collect-only \
	    -p no:cacheprovider >/dev/null 2>&1 & $(MAKE) lint; status=$$?; wait; exit $$status
	env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -m pytest -q $(PYTEST_PARALLEL) \
	    --durations=40

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
	.venv/bin/mfotel rules --topology sharded --out examples/prometheus/rules

dashboards: assets
