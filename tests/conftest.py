"""Fixtures of every test: a free port, a temporary working directory, no launcher variables,
rank exporters, certificates; and the guard that fails a module, or the run, when a process
a test started outlives it (tests/support/leaks.py)."""
from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mfotel.localstack.servers import PORTS_ENV, PORTS_LOW, ephemeral_low, free_port_block
from tests.support import leaks
from tests.support.endpoint import Pki, make_pki, self_signed
from tests.support.ranks import RankExporter, rank_exporter
from tests.support.scheduling import (
    ONE_BY_ONE,
    WHOLE_JOB,
    LongestFirstScheduling,
    expected_seconds,
)
from tests.support.users import shared_dir

_LEFT_RUNNING = pytest.StashKey[str]()

def _children_get_default_signals() -> None:
    """A suite started in the background (`make test &`, nohup) inherits SIGINT, SIGQUIT and
    SIGHUP ignored, and exec keeps them ignored in every process the tests start: the tests of
    signal handling would see a launcher that honours an inherited SIG_IGN, as it should. A
    Python-level handler is reset to the default by exec: the test processes keep ignoring
    (SIGINT gets Python's own default handler), the processes they start get the defaults."""
    for signum in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
        if signal.getsignal(signum) is signal.SIG_IGN:
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT
                          else lambda *_: None)


#: Go's garbage collector target for the servers the tests start (Prometheus, Alertmanager,
#: VictoriaMetrics, vmalert): at GOGC=400 a Prometheus evaluating the shipped rules every
#: second used 17% less CPU (60 -> 101 MB), and the suite runs dozens of them on 2 cores.
#: promtool gets its own (tests/support/promtool.py); a GOGC of the caller's own is kept.
GO_GC_PERCENT = "400"


def _own_ports(config: pytest.Config) -> None:
    """Each xdist worker picks free ports from its own range (PORTS_ENV, inherited by what it
    starts): a port one worker picked for a job is bound seconds to minutes later, and another
    worker's job once took it meanwhile (the test scraped another job's step 1)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None or PORTS_ENV in os.environ:
        return
    index, count = int(workerinput["workerid"].removeprefix("gw")), workerinput["workercount"]
    low, high = PORTS_LOW, ephemeral_low()
    size = (high - low) // count
    os.environ[PORTS_ENV] = f"{low + index * size}-{low + (index + 1) * size - 1}"


def pytest_configure(config: pytest.Config) -> None:
    _children_get_default_signals()
    os.environ.setdefault("GOGC", GO_GC_PERCENT)
    _own_ports(config)
    xdist_controller = bool(getattr(config.option, "numprocesses", None)) \
        and not hasattr(config, "workerinput")
    leaks.mark_this_process(runs_tests=not xdist_controller)


@pytest.fixture(scope="session", autouse=True)
def _mindspore_on_the_cpu() -> None:
    """MindSpore's device is per process and can only be set before the first kernel runs: set
    it once per test process, as a training script does first, so that no test depends on
    which test ran before it in the same process (xdist workers run modules in any order)."""
    os.environ.setdefault("GLOG_v", "3")
    import mindspore  # a test dependency: fail, never skip
    mindspore.set_device("CPU")


@pytest.fixture(scope="module", autouse=True)
def _nothing_outlives_the_module(request: pytest.FixtureRequest) -> Iterator[None]:
    """After the module's tests and fixtures: no process they started may still run."""
    yield
    found = leaks.survivors()
    if found:
        pytest.fail(f"{request.node.nodeid} left {len(found)} process(es) running "
                    f"(killed now):\n{leaks.end(found)}", pytrace=False)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest first: with `pytest -n`, the whole-job tests (tests/support/scheduling.py, by
    their expected seconds, the longest first), then the rest of ONE_BY_ONE, the other slow
    ones, end-to-end, unit tests, so that the long ones start at once and the short ones fill
    the gaps (the order within each group is kept)."""
    def group(item: pytest.Item) -> tuple[int, float]:
        module = item.nodeid.split("::", 1)[0]
        if module in WHOLE_JOB:
            return 0, -expected_seconds(item.nodeid)
        if module in ONE_BY_ONE:
            return 1, 0.0
        if item.get_closest_marker("slow"):
            return 2, 0.0
        return 3 if "tests/e2e/" in item.nodeid else 4, 0.0
    items.sort(key=group)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadscope` (the Makefile's) schedules longest first (tests/support/scheduling)."""
    if config.getvalue("dist") == "loadscope":
        return LongestFirstScheduling(config, log)
    return None


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workerinput"):
        return  # a worker: its modules were checked; the controller checks the run
    found = leaks.session_survivors()
    if found:
        session.config.stash[_LEFT_RUNNING] = leaks.end(found)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    report = config.stash.get(_LEFT_RUNNING, None)
    if report:
        terminalreporter.section("processes left running by the tests (killed)", red=True)
        terminalreporter.write_line(report)


@pytest.fixture
def port() -> int:
    """A free port below the ephemeral range (where no outgoing connection can take it)."""
    return free_port_block(1)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run in a temporary working directory (relative monitor paths land there)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(autouse=True)
def _no_rank_env(monkeypatch):
    """Tests start as a single rank-0 process unless they set the launcher variables."""
    for name in ("RANK_ID", "RANK", "RANK_SIZE", "WORLD_SIZE", "LOCAL_RANK", "DEVICE_ID"):
        monkeypatch.delenv(name, raising=False)
    os.environ.setdefault("GLOG_v", "3")


@pytest.fixture
def rank_exporters() -> Iterator[Callable[..., RankExporter]]:
    """A factory of hand-built rank exporters (tests.support.ranks.rank_exporter), every one
    shut down after the test."""
    made: list[RankExporter] = []

    def make(*args: Any, **kwargs: Any) -> RankExporter:
        made.append(rank_exporter(*args, **kwargs))
        return made[-1]
    yield make
    for exporter in made:
        exporter.shutdown()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with a self-signed certificate for 127.0.0.1: cert.pem, key.pem."""
    return self_signed(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A CA, a server certificate and client certificates (tests.support.endpoint.Pki)."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory every user may enter, removed afterwards (the control files' permission
    tests switch users: tests/support/users.py)."""
    with shared_dir() as path:
        yield path
