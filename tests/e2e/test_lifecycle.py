"""The end of a run, however it comes: a cancelled run (SIGTERM, SIGINT) reports status 4,
lingers for the final scrape, exits the way the signal would, and pages nobody; an exception
reports status 3 before it leaves train(); a SIGKILL still pages; nothing at the end raises
into MindSpore. Real training processes, real signals, real Prometheus with the generated
rules (test thresholds: `for` of seconds, not minutes)."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from mfotel import contract
from mfotel.callback import OTelMonitor
from mfotel.config import parse_config
from mfotel.demo.training import SyntheticRegression, build_model, run_demo
from mfotel.localstack.servers import Prometheus
from tests.support.metrics import samples, scrape, value
from tests.support.multirank import EndpointPoller, child_env, stop
from tests.support.paths import SUPPORT
from tests.support.processes import children, signal_all
from tests.support.prometheus import INTERVAL, RANK_DOWN_FOR, alerts_until_quiet, rules_prometheus
from tests.support.training import at_step
from tests.support.waiting import settle, startup, wait_for

pytestmark = pytest.mark.slow

SCRIPT = SUPPORT / "scripts" / "lifecycle_train.py"
JOB = "lifecycle"


class Run:
    """lifecycle_train.py in its own process (its own process group), output in files."""

    def __init__(self, tmp_path: Path, **opts: Any) -> None:
        self.out, self.err = tmp_path / "run.out", tmp_path / "run.err"
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            # PWD too: MindSpore writes its compile-failure dumps (rank_0/om) under $PWD
            self.process = subprocess.Popen([sys.executable, str(SCRIPT), json.dumps(opts)],
                                            env=child_env(PWD=str(tmp_path)), cwd=tmp_path,
                                            stdout=out, stderr=err, start_new_session=True)
        self.url = f"http://127.0.0.1:{opts['port']}/metrics"
        self.exited_at: float | None = None

    def wait_output(self, text: str, timeout: float | None = None) -> None:
        wait_for(lambda: text in self.out.read_text() + self.err.read_text(), timeout or startup(),
                 message=f"{text!r} in the run's output", alive=[self.process])

    def signal(self, signum: int) -> float:
        self.process.send_signal(signum)
        return time.monotonic()

    def wait(self, timeout: float = 60) -> int:
        code = self.process.wait(timeout=timeout)
        self.exited_at = time.time()
        return code

    def stderr(self) -> str:
        return self.err.read_text()


@pytest.fixture
def runs(tmp_path):
    started: list[Run] = []

    def start(**opts: Any) -> Run:
        run = Run(tmp_path, **opts)
        started.append(run)
        return run
    yield start
    for run in started:  # a run still up lingers after SIGTERM (by design): not waited out
        stop(run.process, timeout=2)


@pytest.fixture
def prometheus(tmp_path, port):
    """A real Prometheus scraping `port` every second with the generated rules."""
    with rules_prometheus(tmp_path, [f"127.0.0.1:{port}"]) as prom:
        yield prom


def status_in_prometheus(prom: Prometheus) -> float | None:
    result = prom.query(f'last_over_time(mindformers_train_status{{job_name="{JOB}"}}[5m])')
    return float(result[0]["value"][1]) if result else None


def final_status_in_prometheus(prom: Prometheus, expected: int) -> float | None:
    """The last status Prometheus stored, once it is `expected`: the final scrape is answered
    before the process exits, but Prometheus stores it a moment later."""
    wait_for(lambda: status_in_prometheus(prom) == expected, settle(INTERVAL), 0.1,
             f"the final status {expected} in Prometheus")
    return status_in_prometheus(prom)


def running_in_prometheus(prom: Prometheus, run: Run) -> None:
    wait_for(lambda: status_in_prometheus(prom) == contract.STATUS_RUNNING,
             startup() + settle(INTERVAL), message="status running in Prometheus",
             alive=[run.process])


# ---------------------------------------------------------------- cancelled, failed, killed
# MindSpore's graph executor installs its own SIGINT handler at the first step
# (mindspore::DefaultIntHandler), which sends SIGTERM to the process: during training, Ctrl-C
# arrives as SIGTERM and the run ends killed by SIGTERM, as it would without mfotel.
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_cancelled_run_reports_cancelled_exits_by_sigterm_and_pages_nobody(
        runs, prometheus, port, tmp_path, signum):
    log = tmp_path / "monitor.log"
    run = runs(port=port, linger_seconds=20, log_file=str(log))
    running_in_prometheus(prometheus, run)
    signalled = run.signal(signum)
    assert run.wait() == -signal.SIGTERM  # the default action, after the linger
    assert time.monotonic() - signalled < 20  # the linger ended at the final scrape
    assert final_status_in_prometheus(prometheus, contract.STATUS_CANCELLED) == \
        contract.STATUS_CANCELLED
    assert alerts_until_quiet(prometheus, JOB, run.exited_at) == []  # no page, no status alert
    text = log.read_bytes()
    assert text.endswith(b"\n") and b"[Monitor] step: 1," in text  # whole lines, flushed
    assert "Traceback" not in run.stderr()


def test_sigterm_leaves_every_monitor_line_written_in_order(runs, port, tmp_path):
    """Lines are written by their own thread: a run ended by SIGTERM (mfotel.lifecycle
    finishes the monitor, then the signal's default action) still has the line of every step
    the monitor recorded, each whole, in step order."""
    log = tmp_path / "monitor.log"
    run = runs(port=port, linger_seconds=0, log_file=str(log), step_seconds=0.005)
    run.wait_output("step 60")
    run.signal(signal.SIGTERM)
    assert run.wait() == -signal.SIGTERM
    printed = [int(line.split()[1]) for line in run.out.read_text().splitlines()
               if line.startswith("step ")]   # printed after the monitor recorded the step
    text = log.read_text()
    assert text.endswith("\n")
    steps = [int(line.split(",")[0].split(": ")[1]) for line in text.splitlines()]
    assert steps == list(range(1, len(steps) + 1))      # in order, none missing
    assert len(steps) >= max(printed) >= 60              # every recorded step's line
    assert all(", time: " in line for line in text.splitlines())


def test_killed_rank_still_pages_rank_down(runs, prometheus, port):
    run = runs(port=port, linger_seconds=20)
    running_in_prometheus(prometheus, run)
    run.signal(signal.SIGKILL)
    assert run.wait() == -signal.SIGKILL
    firing = 'ALERTS{alertname="MindFormersRankDown", alertstate="firing"}'
    [alert] = wait_for(lambda: prometheus.query(firing), settle(INTERVAL, RANK_DOWN_FOR, INTERVAL),
                       message="MindFormersRankDown firing")
    assert (alert["metric"]["job_name"], alert["metric"]["severity"]) == (JOB, "critical")
    assert status_in_prometheus(prometheus) == contract.STATUS_RUNNING


def test_exception_inside_training_reports_failed_before_the_process_exits(
        runs, prometheus, port):
    run = runs(port=port, linger_seconds=20, raise_at=40)
    assert run.wait(timeout=180) == 1  # Python's unhandled exception
    assert "RuntimeError: data loader broke at step 40" in run.stderr()
    assert final_status_in_prometheus(prometheus, contract.STATUS_FAILED) == contract.STATUS_FAILED
    alerts = alerts_until_quiet(prometheus, JOB, run.exited_at)
    # an exception ended the job's training: its rank is paged (Alertmanager mutes the
    # warning beside it)
    assert {(a["alertname"], a["severity"]) for a in alerts} == {
        ("MindFormersRankFailed", "critical"), ("MindFormersTrainingFailed", "warning")}


# ---------------------------------------------------------------- where the signal lands
def test_previous_handler_is_chained_and_decides_the_exit(runs, port, tmp_path):
    """A SIGTERM handler installed before training (a launcher's, a framework's) still runs
    after mfotel reported the cancel, and decides the exit: here sys.exit(99)."""
    marker = tmp_path / "previous-handler-ran"
    run = runs(port=port, linger_seconds=20, previous_handler=str(marker), previous_exits=True)
    run.wait_output("step 20")
    with EndpointPoller({"r": run.url}) as poller:
        run.signal(signal.SIGTERM)
        assert run.wait() == 99
    assert marker.read_text() == str(int(signal.SIGTERM))
    assert value(poller.bodies["r"][-1], "mindformers_train_status") == contract.STATUS_CANCELLED
    assert "Traceback" not in run.stderr()


def test_run_that_goes_on_after_a_signal_reports_running_then_completed(runs, port, tmp_path):
    """The previous handler only takes note (as MindSpore's OnRequestExit does without
    MS_ENABLE_GRACEFUL_EXIT), so training goes on: the status says so, and the run ends
    completed, not cancelled."""
    marker = tmp_path / "previous-handler-ran"
    run = runs(port=port, linger_seconds=20, previous_handler=str(marker), steps=300)
    run.wait_output("step 20")
    with EndpointPoller({"r": run.url}) as poller:
        wait_for(lambda: poller.bodies["r"], settle(poller.interval), message="a scrape",
                 alive=[run.process])
        scraped_before = len(poller.bodies["r"])
        run.signal(signal.SIGTERM)
        assert run.wait() == 0
    assert marker.exists() and "returned" in run.out.read_text()
    after = [value(body, "mindformers_train_status")
             for body in poller.bodies["r"][scraped_before:]]
    # cancelled at most until the step in progress ended, then running until completed
    last_cancelled = max((i for i, s in enumerate(after) if s == contract.STATUS_CANCELLED),
                         default=-1)
    assert contract.STATUS_RUNNING in after[last_cancelled + 1:]
    assert after[-1] == contract.STATUS_COMPLETED


def test_sigterm_while_a_step_never_returns_still_reports_cancelled_and_exits(runs, port):
    """The main thread is in native code with the GIL released (a collective whose peer is
    gone) and never runs the Python handler: the watcher thread reports, lingers, and ends
    the process with 128 + SIGTERM."""
    run = runs(port=port, linger_seconds=20, stuck_at=20)
    run.wait_output("step 20")
    with EndpointPoller({"r": run.url}) as poller:
        run.signal(signal.SIGTERM)
        assert run.wait(timeout=30) == 128 + signal.SIGTERM
    statuses = [value(body, "mindformers_train_status") for body in poller.bodies["r"]]
    assert statuses[-1] == contract.STATUS_CANCELLED


def test_sigterm_during_graph_compilation_reports_cancelled(runs, port):
    """Before the first step (status 0) the main thread compiles the graph, holding the GIL;
    the handler runs when the compiler calls back into Python."""
    run = runs(port=port, linger_seconds=20, layers=150)
    with EndpointPoller({"r": run.url}) as poller:
        wait_for(lambda: poller.bodies["r"], startup(), message="the endpoint up",
                 alive=[run.process])
        assert value(poller.bodies["r"][-1], "mindformers_train_status") == \
            contract.STATUS_INITIALISING
        run.signal(signal.SIGTERM)
        assert run.wait() == -signal.SIGTERM
    assert value(poller.bodies["r"][-1], "mindformers_train_status") == contract.STATUS_CANCELLED
    assert "step 1\n" not in run.out.read_text()


def test_sigint_before_the_first_step_is_a_keyboard_interrupt(runs, port):
    """Before MindSpore installs its own SIGINT handler (at the first step), SIGINT is
    Python's KeyboardInterrupt: it ends the run as cancelled, and the unhandled exception ends
    Python by SIGINT. (Not during graph compilation: MindSpore's compiler sometimes swallows a
    KeyboardInterrupt and trains on, with or without mfotel.)"""
    run = runs(port=port, linger_seconds=20, setup_seconds=60)
    run.wait_output("setting up")
    with EndpointPoller({"r": run.url}) as poller:
        wait_for(lambda: poller.bodies["r"], startup(), message="the endpoint up",
                 alive=[run.process])
        run.signal(signal.SIGINT)
        assert run.wait() == -signal.SIGINT
    assert value(poller.bodies["r"][-1], "mindformers_train_status") == contract.STATUS_CANCELLED
    assert "KeyboardInterrupt" in run.stderr()


def test_sigterm_during_the_final_linger_keeps_completed_and_exits_after_the_scrape(runs, port):
    run = runs(port=port, linger_seconds=60, steps=20)
    run.wait_output("keeping /metrics up for the final scrape")
    run.signal(signal.SIGTERM)
    body = samples(scrape(run.url))  # answered: the signal did not cut the linger short
    assert value(body, "mindformers_train_status") == contract.STATUS_COMPLETED
    assert run.wait() == -signal.SIGTERM


def ended(pid: int) -> bool:
    """Exited: gone, or a zombie its parent has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_dataset_worker_killed_reports_failed_not_cancelled(runs, port):
    """MindSpore answers a dataset worker's death by sending SIGTERM to the training process;
    a worker killed by the OOM killer (SIGKILL) is a failure, and the run says so."""
    run = runs(port=port, linger_seconds=20, dataset_workers=2)
    run.wait_output("step 20")
    with EndpointPoller({"r": run.url}) as poller:
        workers = children(run.process.pid)
        assert workers, "the dataset workers"
        # one worker's death may end the others before their turn (and free their pids)
        assert signal_all(workers, signal.SIGKILL) >= 1
        assert run.wait() == -signal.SIGTERM
    assert value(poller.bodies["r"][-1], "mindformers_train_status") == contract.STATUS_FAILED
    assert "was killed by Killed" in run.stderr() and "status failed" in run.stderr()


def test_forked_child_is_not_the_training_run(runs, port):
    """A process forked during training (a data worker) inherits the signal handlers: it
    must die of SIGTERM at once, and the run must not take the child's signal for its own."""
    run = runs(port=port, linger_seconds=20, fork_at=10)
    run.wait_output("child ")
    child = int(run.out.read_text().split("child ")[1].split()[0])
    os.kill(child, signal.SIGTERM)
    wait_for(lambda: ended(child), settle(), message="the forked child ended by SIGTERM",
             alive=[run.process])
    steps_then = run.out.read_text().count("step ")
    run.wait_output(f"step {steps_then + 20}\n")  # training went on
    body = samples(scrape(run.url))
    assert value(body, "mindformers_train_status") == contract.STATUS_RUNNING


# ---------------------------------------------------------------- in-process: the end never raises


def train_end_recorder() -> Any:
    from mindspore.train import Callback

    class TrainEnd(Callback):
        ran = False

        def on_train_end(self, run_context: Any) -> None:
            self.ran = True  # e.g. the final checkpoint
    return TrainEnd()


def train(monitor: OTelMonitor, steps: int, *callbacks: Any) -> None:
    """The demo network, `monitor` first, then `callbacks`."""
    import mindspore as ms
    import mindspore.dataset as ds
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    dataset = ds.GeneratorDataset(SyntheticRegression(steps, 8), ["x", "y"],
                                  shuffle=False).batch(8)
    build_model(steps, 8, "constant").train(1, dataset, callbacks=[monitor, *callbacks],
                                            dataset_sink_mode=False)


def test_failing_shutdown_steps_never_skip_the_callbacks_after_it(port, in_tmp, caplog):
    silent_collector = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    targets = in_tmp / "targets"
    cfg = parse_config({
        "job_name": JOB, "metrics": ["loss"],
        "output": {"console": False, "file": True, "file_path": "logs/m.log"},
        "prometheus": {"host": "127.0.0.1", "port": port, "linger_until_scraped": False},
        "otlp": {"endpoint": f"http://127.0.0.1:{silent_collector.getsockname()[1]}/v1/metrics",
                 "timeout_seconds": 1},
        "file_sd": {"path": str(targets / "job.json")}})
    # an absurd linger, handed to the dataclass as a program would (no config validation)
    cfg = dataclasses.replace(cfg, prometheus=dataclasses.replace(cfg.prometheus,
                                                                  linger_seconds=1e10))
    monitor, after = OTelMonitor(cfg), train_end_recorder()

    def break_outputs() -> None:  # the sink's directory goes; file_sd's becomes a file
        shutil.rmtree(in_tmp / "logs")
        shutil.rmtree(targets)
        targets.write_text("not a directory")
    try:
        with caplog.at_level(logging.WARNING, logger="mfotel"):
            train(monitor, 10, at_step(5, break_outputs), after)
    finally:
        silent_collector.close()
    assert after.ran
    state = monitor.instruments.state
    assert state.status == contract.STATUS_COMPLETED
    assert state.export_errors["shutdown"] == 2  # the linger and the file_sd removal
    # the final push runs on the SDK's export thread (shutdown waits otlp.timeout_seconds):
    # its failure is counted there, never raised
    wait_for(lambda: state.export_errors["otlp"] >= 1, settle(cfg.otlp.timeout_seconds),
             message="the failed final OTLP push counted")
    ends = [r.getMessage() for r in caplog.records if "failed at the end" in r.getMessage()]
    assert len(ends) == 2
    assert "linger failed" in ends[0] and "OverflowError" in ends[0]
    assert "file_sd failed" in ends[1] and "NotADirectoryError" in ends[1]
    last_line = (in_tmp / "logs" / "m.log").read_text().splitlines()[-1]
    assert last_line.startswith("[Monitor] step: 10,")  # the sink recreated its directory
    with pytest.raises(OSError):
        scrape(f"http://127.0.0.1:{port}/metrics")  # the endpoint stopped all the same


@pytest.mark.parametrize("error, status", [(RuntimeError, contract.STATUS_FAILED),
                                           (KeyboardInterrupt, contract.STATUS_CANCELLED)],
                         ids=["exception", "KeyboardInterrupt"])
def test_error_leaving_train_is_reported_before_it_propagates(port, in_tmp, error, status):
    monitor = OTelMonitor(job_name=JOB, metrics=["loss"], output={"console": False},
                          prometheus={"host": "127.0.0.1", "port": port, "linger_seconds": 30})

    def fail() -> None:
        raise error("raised by a later callback")
    with EndpointPoller({"r": f"http://127.0.0.1:{port}/metrics"}, interval=0.05) as poller:
        with pytest.raises(error):
            train(monitor, 40, at_step(10, fail))
        # train() has raised: the final status was served and the endpoint is down
        assert monitor.final_scraped
        with pytest.raises(OSError):
            scrape(f"http://127.0.0.1:{port}/metrics")
    assert value(poller.bodies["r"][-1], "mindformers_train_status") == status
    assert value(poller.bodies["r"][-1], "mindformers_train_step") == 10


def test_ignored_signal_stays_ignored_and_handlers_are_restored(port, in_tmp):
    during: dict[str, Any] = {}

    def look() -> None:
        during.update(term=signal.getsignal(signal.SIGTERM), int=signal.getsignal(signal.SIGINT))
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # e.g. started under nohup-like tools
    try:
        run_demo(steps=3, port=port, extra_callbacks=(at_step(2, look),))
        assert during["term"] == signal.SIG_IGN
        assert during["int"] is not signal.default_int_handler  # mfotel's, chaining Python's
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.set_wakeup_fd(-1) == -1  # the watcher's wakeup fd is gone too
    finally:
        signal.signal(signal.SIGTERM, previous)
