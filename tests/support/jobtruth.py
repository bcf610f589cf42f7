"""A real msrun job with one fault, watched by a real Prometheus and Alertmanager with the
shipped configs (the job-level tests): which rank do the alerts and the notifications name?

    with FaultyJob(tmp_path, "input", ranks=2) as job:
        job.wait_alert("MindFormersStragglerRank", timeout=300)
        job.notifications("MindFormersStragglerRank")

The stack is the simulator's (`mfotel.simulation.stack.SimStack`): the shipped
prometheus.yml (its file_sd job pointed at the file rank 0 writes), alertmanager.yml (only the
webhook URL changed) and rules generated with `JOB_RULES` (every `for:` and window shortened,
thresholds as shipped), scraped and evaluated every second.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import yaml

from mfotel.alerting.rules import RulesConfig
from mfotel.alerting.webhook import ReceivedAlert
from mfotel.simulation.stack import SimStack
from tests.support.multirank import (
    VENV_BIN,
    child_env,
    free_port,
    free_port_block,
    start,
    stop,
)
from tests.support.paths import ROOT
from tests.support.waiting import settle, wait_for

SCRIPT = ROOT / "tests" / "support" / "scripts" / "faulty_dp.py"
INSTRUMENT = [sys.executable, "-m", "mfotel.node.instrument"]
#: The shipped thresholds with every `for:` and look-back shortened to seconds (a rank's
#: /metrics can miss a 1 s scrape on a loaded machine: rank down waits 20 s; a stall, as
#: shipped, takes longer than rank down).
JOB_RULES = RulesConfig(
    stall_seconds=40, stall_for="3s", rank_down_for="20s", ranks_missing_for="20s",
    straggler_for="10s", grad_norm_nonfinite_for="5s", nonfinite_settle="10s",
    loss_spike_for="10s", grad_norm_spike_for="10s", loss_divergence_for="10s",
    overflow_storm_for="10s", step_drift_for="10s", checkpoint_for="10s",
    throughput_window="20s", throughput_baseline_window="1m", throughput_drop_for="5s",
    failed_lookback="5m")
INTERVAL = 1.0
#: Steps of a job: with a step sleep of 50 ms, >= 1,000 s of training however idle the machine
#: (a bare step takes 6-10 ms here; 5,000 of them ended jobs before their fault).
STEPS = 20000
T = TypeVar("T")


def read_truth(path: Path) -> dict[str, Any]:
    """A rank's truth file (faulty_dp.py `--truth-dir`): {"pid": int | None, "losses": {step:
    loss}, "grad_norms": {step: norm}}, steps as strings. A last line still being appended
    (no newline yet) is left for the next read."""
    found: dict[str, Any] = {"pid": None, "losses": {}, "grad_norms": {}}
    try:
        text = path.read_text()
    except FileNotFoundError:
        return found
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        record = json.loads(line)
        if "pid" in record:
            found["pid"] = int(record["pid"])
        else:
            found["losses"][str(record["step"])] = record["loss"]
            found["grad_norms"][str(record["step"])] = record["grad_norm"]
    return found


class FaultyJob:
    """msrun running tests/support/scripts/faulty_dp.py (`fault` on rank `fault_rank`), the stack,
    and what the alerts said. Stops everything it started."""

    def __init__(self, workdir: Path, fault: str, ranks: int = 2, fault_rank: int = 1,
                 job_name: str = "jt", fast_path: bool = False, join: bool = True,
                 rules: RulesConfig = JOB_RULES, env: dict[str, str] | None = None,
                 steps: int = STEPS, launcher: bool = False,
                 also: dict[str, RulesConfig] | None = None,
                 critical_group_interval: str | None = None,
                 warning_group_wait: str | None = None, **options: Any) -> None:
        """`join=False`: msrun starts the job and returns, leaving the ranks alone (with
        `--join=True` it SIGKILLs every rank as soon as one exits with an error). `env`: more
        environment for msrun and its ranks (MindSpore's own settings, e.g. MS_NODE_TIMEOUT).
        `launcher`: msrun runs under `mfotel-instrument --config job.yaml` (the YAML holds the
        ranks' monitor settings), whose node agent serves the node endpoint on the ranks'
        port - 1 and writes its file_sd target beside rank 0's. `also`: more stacks (own
        Prometheus, Alertmanager and webhook) watching the same job with other rules, by name
        (`stacks[name]`; the main one is `stack`). `critical_group_interval`: the shipped
        routes but the critical route's `group_interval` (a group that changes notifies again
        that much later: shorter, a second page of an incident shows sooner).
        `warning_group_wait`: the warning route's `group_wait` (30s as shipped), for an alert
        that fires shorter than the shipped wait allows under load.
        `options`: faulty_dp.py's other flags (seconds=1.0 is `--seconds 1.0`)."""
        self.workdir, self.fault, self.ranks = workdir, fault, ranks
        self.fault_rank, self.job_name, self.fast_path = fault_rank, job_name, fast_path
        self.join, self.options, self.env = join, {"steps": steps, **options}, env or {}
        self.launcher = launcher
        self.port = 0
        self.truth = workdir / "truth"
        self.targets = workdir / "targets" / "job.json"
        self.rules = rules
        self.stack = SimStack(workdir, workdir / "targets" / "*.json", INTERVAL, rules)
        self.stacks = {name: SimStack(workdir / f"stack-{name}", workdir / "targets" / "*.json",
                                      INTERVAL, more) for name, more in (also or {}).items()}
        for stack in (self.stack, *self.stacks.values()):
            if critical_group_interval is not None:
                set_route(stack, "critical", group_interval=critical_group_interval)
            if warning_group_wait is not None:
                set_route(stack, "warning", group_wait=warning_group_wait)
        self._watchers: list[AlertWatch] = []
        self.msrun: subprocess.Popen | None = None
        self.started = 0.0
        #: When `wait_running` first saw every rank running: the alerts that began earlier are
        #: the start-up's (under the suite's load a rank may come up 20 s after another, and
        #: JOB_RULES' ranks_missing_for is 20s), outside what a fault test counts.
        self.running_at: float | None = None
        self._logs_read: dict[Path, int] = {}   # how far _port_taken read each rank's log

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> FaultyJob:
        self.stack.start()
        try:
            for stack in self.stacks.values():
                stack.start()
            self._launch()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _launch(self) -> None:
        # with the launcher, its node endpoint takes the port below the ranks' (the default)
        block = free_port_block(self.ranks + 1)
        self.port = port = block + 1
        args = ["--fault", self.fault, "--fault-rank", str(self.fault_rank), "--port", str(port),
                "--job-name", self.job_name, "--file-sd", str(self.targets),
                "--truth-dir", str(self.truth)]
        if self.fast_path:
            args += ["--alertmanager-url", self.stack.alertmanager.url]
        for key, value in self.options.items():
            flag = "--" + key.replace("_", "-")
            args += [flag] if value is True else [flag, str(value)]
        command = [str(VENV_BIN / "msrun"), f"--worker_num={self.ranks}",
                   f"--local_worker_num={self.ranks}", "--master_addr=127.0.0.1",
                   f"--master_port={free_port()}", f"--join={self.join}",
                   f"--log_dir={self.workdir / 'msrun-logs'}", str(SCRIPT), *args]
        if self.launcher:
            command = [*INSTRUMENT, "--config", str(self._monitor_yaml()),
                       "--node-probe-interval", "1", *command]
        self.started = time.time()
        # TMPDIR: a launcher killed at the end leaves its node directory in the test's folder
        self.msrun = start(command, child_env(TMPDIR=str(self.workdir), **self.env),
                           self.workdir / "msrun.log", self.workdir)

    def _monitor_yaml(self) -> Path:
        """The ranks' monitor settings as faulty_dp.py passes them, for the launcher."""
        path = self.workdir / "job.yaml"
        prometheus = {"host": "127.0.0.1", "port": self.port,
                      "linger_seconds": float(self.options.get("linger_seconds", 30.0)),
                      "linger_until_scraped": False}
        path.write_text(yaml.safe_dump({"monitor_config": {
            "job_name": self.job_name, "prometheus": prometheus,
            "file_sd": {"path": str(self.targets)}}}))
        return path

    def pids(self) -> dict[int, int]:
        """rank -> pid of the ranks that began writing their truth file."""
        found = {}
        for rank in range(self.ranks):
            pid = self.truth_of(rank)["pid"]
            if pid is not None:
                found[rank] = pid
        return found

    def truth_of(self, rank: int) -> dict[str, Any]:
        """What rank `rank` computed so far (`read_truth` of its file)."""
        return read_truth(self.truth / f"rank_{rank}.jsonl")

    def stop(self) -> None:
        """Kill the ranks and msrun's scheduler, then stop msrun and the stack. The test has
        read what it needs: a cancel (SIGTERM) would keep each rank lingering 30 s for a
        scrape nobody reads (30 s of every test's teardown), and msrun's scheduler would wait
        out MS_NODE_TIMEOUT for the ranks it lost. msrun starts each worker in its own
        session: its own signals never reach them, so each is killed with its group."""
        for pid in self._processes():   # the workers and msrun's scheduler
            self._signal(pid, signal.SIGKILL, group=True)
        if self.msrun is not None:
            stop(self.msrun)
        for watcher in self._watchers:
            watcher.close()
        for stack in (self.stack, *self.stacks.values()):
            stack.stop()

    def _ours(self, pid: int) -> bool:
        """Whether `pid` runs this job's script (its port is this job's: not a reused pid)."""
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        return str(SCRIPT).encode() in argv and str(self.port).encode() in argv

    def _processes(self) -> set[int]:
        return {int(entry.name) for entry in Path("/proc").iterdir()
                if entry.name.isdigit() and self.port and self._ours(int(entry.name))}

    def _signal(self, pid: int, signum: int, group: bool = False) -> None:
        if not self._ours(pid):
            return
        try:
            if group:
                os.killpg(pid, signum)   # a worker leads its own session and process group
            else:
                os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    # ------------------------------------------------------------ what Prometheus says
    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.stack.prometheus.query(expr)

    def value_by_rank(self, expr: str) -> dict[str, float]:
        return {r["metric"]["rank"]: float(r["value"][1]) for r in self.query(expr)}

    def sel(self, *matchers: str) -> str:
        return ", ".join([f'job_name="{self.job_name}"', *matchers])

    def wait_running(self, timeout: float = 300, seconds: float = 0) -> None:
        """Every rank running and scraped (for `seconds` of scrapes)."""
        expr = f"mindformers_train_status{{{self.sel()}}} == 1"
        if seconds:
            expr = f"count_over_time(({expr})[{int(seconds)}s:1s]) >= {int(seconds)}"
        self.wait(lambda: len(self.query(expr)) == self.ranks, timeout, 1.0,
                  "every rank running in Prometheus")
        if self.running_at is None:
            self.running_at = time.time()

    def since_running(self, alert: ReceivedAlert) -> bool:
        """Whether `alert` began (startsAt) once every rank ran (`running_at`)."""
        return self.running_at is None or \
            datetime.fromisoformat(alert.starts_at).timestamp() >= self.running_at

    def wait(self, predicate: Callable[[], T], timeout: float, interval: float,
             message: str) -> T:
        """`wait_for` (timeout scaled by `settle`) for what needs the job running: a joined
        job that ends first (msrun exits when every rank has) fails the wait at once, with
        the ranks' last log lines. A query that times out is "not yet" (a Prometheus on a
        machine at a load of 12 took more than 5 s to answer a query now and then). A rank
        that cannot serve /metrics (its port taken) fails it at once: nothing awaited can come
        (a wait once ran out its 22 minutes for it)."""
        def checked() -> T:
            taken = self._port_taken()
            if taken:
                raise AssertionError(taken)
            return predicate()
        return wait_for(checked, settle(timeout), interval, message,
                        alive=(self.msrun,) if self.join else (), ignore=(TimeoutError,),
                        details=self.log_tail)

    def _port_taken(self) -> str | None:
        """The first line a rank logged saying it cannot serve /metrics, if any; each log is
        read on from where the last look stopped (a wait polls it several times a second)."""
        for log in (self.workdir / "msrun-logs").glob("worker_*.log"):
            with open(log, "rb") as handle:
                handle.seek(self._logs_read.get(log, 0))
                new = handle.read()
            whole = new[:new.rfind(b"\n") + 1]   # a line still being written: next time
            self._logs_read[log] = self._logs_read.get(log, 0) + len(whole)
            for line in whole.splitlines():
                if b"cannot serve /metrics" in line:
                    return f"{log.name}: {line.decode(errors='replace')}"
        return None

    def log_tail(self, lines: int = 5) -> str:
        """The last `lines` lines of each rank's msrun log."""
        tails = []
        for log in sorted((self.workdir / "msrun-logs").glob("worker_*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            tails.append(f"{log.name}:\n" + "\n".join(tail))
        return "\n".join(tails)

    def trigger(self) -> float:
        """Start a fault waiting for its trigger file; the unix time it did. Every rank must
        still have steps to train: a job that ran out of steps first (fast steps on an idle
        machine) would leave the test waiting for an alert of a fault that never happened."""
        path = Path(self.options["trigger"])
        path.touch()
        steps = int(self.options["steps"])
        trained = {rank: max(map(int, self.truth_of(rank)["losses"]), default=0)
                   for rank in range(self.ranks)}
        assert all(step < steps for step in trained.values()), (
            f"the job trained all its {steps} steps before the fault (last step by rank: "
            f"{trained}): give it more steps or a step sleep")
        return path.stat().st_mtime

    def firing(self, alertname: str) -> list[dict[str, str]]:
        return [r["metric"] for r in self.query(
            f'ALERTS{{{self.sel(f"alertname={json.dumps(alertname)}")}, alertstate="firing"}}')]

    def wait_alert(self, alertname: str, timeout: float) -> list[dict[str, str]]:
        """The firing `alertname` alerts, once there are any; the job must be running."""
        return self.wait(lambda: self.firing(alertname), timeout, 1.0, f"{alertname} firing")

    def ever_fired(self, alertname: str, window: str = "30m") -> list[dict[str, str]]:
        """Every (label set of) `alertname` that fired since the job began (within `window`)."""
        return [r["metric"] for r in self.query(
            f'max_over_time(ALERTS{{{self.sel(f"alertname={json.dumps(alertname)}")}, '
            f'alertstate="firing"}}[{window}])')]

    def watch(self, stack: SimStack | None = None) -> AlertWatch:
        """Every ALERTS series of the job that `stack`'s Prometheus (default: the main one)
        shows from now on, polled in the background until the job stops."""
        watcher = AlertWatch(stack or self.stack, self.job_name, lambda: self.running_at)
        self._watchers.append(watcher)
        return watcher

    def ranks_gone(self) -> bool:
        """Whether every rank process ended (msrun's scheduler may linger: with a long
        `MS_NODE_TIMEOUT` it waits that long again for the ranks it lost)."""
        pids = self.pids()
        return len(pids) == self.ranks and not any(map(self._ours, pids.values()))

    def processes_gone(self) -> bool:
        """Whether every process of the job's script ended (ranks and msrun's scheduler)."""
        return not self._processes()

    # ------------------------------------------------------------ what was notified
    def notifications(self, alertname: str | None = None,
                      stack: SimStack | None = None) -> list[list[ReceivedAlert]]:
        """The firing notifications about the job (optionally with `alertname`), each as the
        list of its alerts that began once every rank ran: one webhook call each."""
        calls: dict[tuple[str, float], list[ReceivedAlert]] = {}
        for alert in (stack or self.stack).receiver.received(
                lambda a: a.firing and a.labels.get("job_name") == self.job_name
                and self.since_running(a)):
            if alertname is None or alert.alertname == alertname:
                calls.setdefault((alert.group_key, alert.received_at), []).append(alert)
        return [calls[key] for key in sorted(calls, key=lambda k: k[1])]

    def wait_notified(self, alertname: str, timeout: float,
                      stack: SimStack | None = None) -> list[ReceivedAlert]:
        wait_for(lambda: self.notifications(alertname, stack), settle(timeout), 1.0,
                 f"a notification of {alertname}", details=self.log_tail)
        return self.notifications(alertname, stack)[0]

    def history(self, stack: SimStack | None = None) -> list[tuple[float, str, str, str, str]]:
        """Every alert of the job received, firing or resolved, in order: (seconds after the
        start, status, alertname, rank, startsAt): what a failed page count is read from."""
        return [(round(a.received_at - self.started, 1), a.status, a.alertname,
                 a.labels.get("rank", ""), a.starts_at)
                for a in (stack or self.stack).receiver.received(
                    lambda a: a.labels.get("job_name") == self.job_name)]

    def pages(self, stack: SimStack | None = None) -> list[list[tuple[str, str | None]]]:
        """The critical notifications about the job: [(alertname, rank or None), ...] each."""
        return [[(a.alertname, a.labels.get("rank")) for a in call]
                for call in self.notifications(stack=stack)
                if call[0].labels.get("severity") == "critical"]


def set_route(stack: SimStack, severity: str, **timing: str) -> None:
    """The shipped Alertmanager config of `stack` (not started yet) with other timings
    (`group_interval=...`, `group_wait=...`) on the route of `severity`."""
    config = yaml.safe_load(stack.files["alertmanager"])
    matchers = [f'severity = "{severity}"']
    routes = [r for r in config["route"]["routes"] if r.get("matchers") == matchers]
    assert len(routes) == 1, f"the shipped config's {severity} route moved"
    routes[0].update(timing)
    stack.files["alertmanager"] = yaml.safe_dump(config, sort_keys=False)
    stack.am_config = config


class AlertWatch:
    """ALERTS of one job as a Prometheus shows them, polled every 0.5 s in a thread; what
    `since()` gives (a unix time or None) leaves out the alerts seen firing before it."""

    def __init__(self, stack: SimStack, job_name: str,
                 since: Callable[[], float | None] = lambda: None) -> None:
        self.stack, self.job_name, self.since = stack, job_name, since
        self.seen: list[tuple[float, dict[str, str]]] = []   # (first seen in its episode, row)
        self.first_seen: dict[tuple[str, str | None], float] = {}  # (alertname, rank) -> when
        self._began: dict[frozenset[tuple[str, str]], float] = {}  # firing now, since when
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        expr = f'ALERTS{{job_name="{self.job_name}", alertstate="firing"}}'
        while not self._stop.wait(0.5):
            try:
                rows = [row["metric"] for row in self.stack.prometheus.query(expr)]
                now = time.time()
                began = {key: self._began.get(key, now)
                         for key in (frozenset(row.items()) for row in rows)}
                for row in rows:
                    self.first_seen.setdefault((row["alertname"], row.get("rank")), now)
                    self.seen.append((began[frozenset(row.items())], row))
                self._began = began
            except (OSError, TimeoutError):
                pass

    def critical(self) -> set[tuple[str, str | None]]:
        """(alertname, rank or None) of every critical alert seen firing, from `since()` on
        (an alert firing then, gone and firing again is seen again)."""
        since = self.since() or 0.0
        return {(a["alertname"], a.get("rank")) for began, a in self.seen
                if a.get("severity") == "critical" and began >= since}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
