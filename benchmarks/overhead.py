"""Training-thread cost of OTelMonitor per step, against baselines measured in the same run.

    .venv/bin/python benchmarks/overhead.py [--steps 3000] [--repeats 9]

Each variant trains the demo network (real MindSpore, CPU, graph mode, constant lr) and times
what runs inside its callback on the training thread, per step: step begin + step end (train
begin and end, starting and stopping the endpoint, are one-off and not counted). Variants run
interleaved (repeat 1 of every variant, then repeat 2, ...), so drift hits all alike; each
figure is the median over the repeats of one run's statistic.

Every baseline reads values the way OTelMonitor does, with `item()` (~0.3 us; `asnumpy()` is
~30x dearer), as a competent engineer would write it:

- empty callback: MindSpore's Callback, whose hooks do nothing: what the timing itself
  measures (its clock reads, cold in the middle of training), in every row alike.
- read floor: reads loss, grad norm and lr and checks they are finite; nothing else. Most of
  its time is waiting for the step's outputs, which every variant pays.
- prometheus_client: a hand-written callback with cached label children: 3 gauges, a
  step-time histogram, a step counter and a last-step timestamp.
- MindSpore LossMonitor: prints the loss every step (stdout goes to /dev/null here, as it
  does for OTelMonitor's console line).

Goals (issues 20 and 34): the per-step path (OTelMonitor at interval 50: steps that record
nothing) at most 1.2x the read floor; a record step with the console off at most 1.2x
prometheus_client; the console line no dearer than LossMonitor's print. Every OTelMonitor row
keeps the process's time account (mfotel.time_account, issue 35) at every step. Issue 21's
job-level signals (time outside the step, the step-begin timestamp) at most 2 us per step:
after the runs, the real step-begin hook and step clock of the interval-50 monitor are timed
with and without them, interleaved, in the same process.

Then the per-part split (`--split-repeats`, 0 for none): what each part of the step path
costs per step, the optional listeners included (the live page's history, an actions rule,
the node link under mfotel-instrument), each part timed on its class in runs of its own, the
rest from untimed runs of the same monitor.

`median` is the median step's wall time in a run (robust to a busy machine: a preempted
step does not move it); `mean` includes record steps and preemption, i.e. what training pays
on average; `CPU` is the median step's thread CPU time, which a preempted step does not
inflate. The wait for the step's outputs costs CPU time too (the floor's CPU time is about its
wall time), and the CPU clock's own reads, cold in the middle of a step, add a little to
every row alike (the empty callback's row). The machine's load average is printed: the ratios
are what to compare between runs, the absolute figures move with the load.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import tempfile
import time
import timeit
from array import array
from collections.abc import Callable, Iterator
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import mindspore as ms
import mindspore.dataset as ds
from mindspore.train import Callback, LossMonitor

from mfotel.actions.engine import ActionEngine
from mfotel.callback import OTelMonitor
from mfotel.contract import STEP_TIME_BUCKETS
from mfotel.demo.training import SyntheticRegression, build_model
from mfotel.localstack.servers import free_port
from mfotel.node_link import ENV_DIR, NodeLink
from mfotel.step_clock import RecordSchedule, StepClock
from mfotel.time_account import TimeAccount
from mfotel.ui.history import HistoryRecorder

ALL_METRICS = ["loss", "learning_rate", "grad_norm", "throughput", "step_time"]
HARNESS = "empty callback (the timing's own cost)"
FLOOR, PROM, LOSS_MONITOR = "read floor (item(), finite?)", "prometheus_client", \
    "MindSpore LossMonitor (print)"
OTEL_1, OTEL_1_CONSOLE, OTEL_50 = ("OTelMonitor interval 1, console off",
                                  "OTelMonitor interval 1, console on",
                                  "OTelMonitor interval 50 (per-step path)")


def _clock_cost() -> float:
    """The thread CPU time an empty Timed window measures (its own clock calls: reading the
    thread's CPU clock is a system call), the median like the figures it is taken from."""
    perf, cpu, samples = time.perf_counter, time.thread_time, []
    for _ in range(5000):
        c0 = cpu()
        perf()
        perf()
        samples.append(cpu() - c0)
    return statistics.median(samples)


class Timed(Callback):  # type: ignore[misc]
    """Runs `inner`'s hooks and keeps the time each step spends in them (training thread):
    wall time (perf_counter) and this thread's CPU time (thread_time, which a preempted
    step does not inflate; its own clock calls are subtracted)."""

    CLOCK_COST = 0.0

    def __init__(self, inner: Callback | None, steps: int) -> None:
        super().__init__()
        self.inner = inner
        self.per_step = array("d", bytes(8 * steps))
        self.cpu_per_step = array("d", bytes(8 * steps))
        self.steps, self.wall = 0, 0.0
        self._begin = self._begin_cpu = 0.0

    def on_train_begin(self, run_context: Any) -> None:
        if self.inner is not None:
            self.inner.on_train_begin(run_context)
        self.wall = time.perf_counter()

    def on_train_step_begin(self, run_context: Any) -> None:
        if self.inner is not None:
            c0 = time.thread_time()
            started = time.perf_counter()
            self.inner.on_train_step_begin(run_context)
            ended = time.perf_counter()
            self._begin_cpu = time.thread_time() - c0 - self.CLOCK_COST
            self._begin = ended - started

    def on_train_step_end(self, run_context: Any) -> None:
        seconds = cpu = 0.0
        if self.inner is not None:
            c0 = time.thread_time()
            started = time.perf_counter()
            self.inner.on_train_step_end(run_context)
            ended = time.perf_counter()
            cpu = time.thread_time() - c0 - self.CLOCK_COST
            seconds = ended - started
        if self.steps < len(self.per_step):
            self.per_step[self.steps] = self._begin + seconds
            self.cpu_per_step[self.steps] = max(self._begin_cpu + cpu, 0.0)
        self.steps += 1

    def on_train_end(self, run_context: Any) -> None:
        self.wall = time.perf_counter() - self.wall
        if self.inner is not None:
            self.inner.on_train_end(run_context)

    def __enter__(self) -> Timed:
        if self.inner is not None:
            self.inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.inner is not None:
            self.inner.__exit__(*exc)


class ReadFloor(Callback):  # type: ignore[misc]
    """Baseline: read loss, grad norm and lr with item() and check they are finite."""

    def __init__(self) -> None:
        super().__init__()
        self.nonfinite = 0

    def on_train_step_end(self, run_context: Any) -> None:
        cb = run_context.original_args()
        loss, norm = cb.net_outputs
        values = (loss.item(), norm.item(), cb.train_network.optimizer.learning_rate.item())
        if not all(math.isfinite(v) for v in values):
            self.nonfinite += 1


class PlainPrometheus(Callback):  # type: ignore[misc]
    """Baseline: prometheus_client with cached children (3 gauges, a step-time histogram, a
    step counter, a timestamp), values read with item()."""

    def __init__(self) -> None:
        super().__init__()
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        registry, labels, mine = CollectorRegistry(), ("job_name", "rank"), ("bench", "0")
        self.loss = Gauge("loss", "", labels, registry=registry).labels(*mine)
        self.lr = Gauge("lr", "", labels, registry=registry).labels(*mine)
        self.norm = Gauge("norm", "", labels, registry=registry).labels(*mine)
        self.seconds = Histogram("step_seconds", "", labels, registry=registry,
                                 buckets=STEP_TIME_BUCKETS).labels(*mine)
        self.steps = Counter("steps", "", labels, registry=registry).labels(*mine)
        self.last = Gauge("last", "", labels, registry=registry).labels(*mine)
        self.started = 0.0

    def on_train_step_begin(self, run_context: Any) -> None:
        self.started = time.perf_counter()

    def on_train_step_end(self, run_context: Any) -> None:
        self.seconds.observe(time.perf_counter() - self.started)
        cb = run_context.original_args()
        loss, norm = cb.net_outputs
        self.loss.set(loss.item())
        self.norm.set(norm.item())
        self.lr.set(cb.train_network.optimizer.learning_rate.item())
        self.steps.inc()
        self.last.set(time.time())


def train(steps: int, callback: Callback | None) -> Timed:
    """One run of the demo model (constant lr) with `callback` timed."""
    source = SyntheticRegression(steps, 8)
    dataset = ds.GeneratorDataset(source, ["x", "y"], shuffle=False).batch(8)
    timed = Timed(callback, steps)
    build_model(steps, 8, "constant").train(1, dataset, callbacks=[timed], dataset_sink_mode=False)
    return timed


def variants() -> dict[str, Callable[[], Callback | None]]:
    def otel(interval: int, console: bool = False) -> Callable[[], Callback]:
        return lambda: OTelMonitor(step_interval=interval, metrics=ALL_METRICS, job_name="bench",
                                   prometheus={"host": "127.0.0.1", "port": free_port(),
                                               "linger_seconds": 0},
                                   output={"console": console})
    return {
        HARNESS: Callback,  # MindSpore's base class: every hook a no-op
        FLOOR: ReadFloor,
        PROM: PlainPrometheus,
        LOSS_MONITOR: lambda: LossMonitor(per_print_times=1),
        OTEL_1: otel(1),
        OTEL_1_CONSOLE: otel(1, console=True),
        OTEL_50: otel(50),
    }


def job_signal_cost(monitor: OTelMonitor, steps: int = 2_000, repeats: int = 41
                    ) -> tuple[float, float]:
    """us per step of the real step-begin hook and the step clock, without and with the
    job-level signals, on a monitor that has trained: with them, `mark_step_begin` also
    stamps the step-begin time and bumps the state's version, and the step end sums the
    time outside the step (as OTelMonitor's step path does); without, the hook only marks
    the clock (the run's parts hidden). Best of `repeats`, interleaved: loops of a few
    milliseconds, so that on a loaded machine some run whole (at load 20, every one of 9
    loops of 20,000 steps was preempted: both figures 2-5x)."""
    recorder = monitor._recorder
    assert recorder is not None, "the monitor has not trained"
    state, account = recorder.state, recorder.account
    recorder.account = None   # the time account is a part of its own (the split)

    def loop(signals: bool) -> Callable[[], None]:
        def run() -> None:
            clock = monitor.clock = StepClock(RecordSchedule(50), 8)
            clock.first_step(0)
            monitor._recorder = recorder if signals else None
            mark, perf = monitor.mark_step_begin, time.perf_counter
            for cur in range(1, steps + 1):
                mark()
                tick = clock.end(cur, perf())
                if signals and tick.outside is not None:
                    state.step_outside += tick.outside
            monitor._recorder = recorder
        return run
    best = {False: math.inf, True: math.inf}
    for _ in range(repeats):
        for signals in best:
            best[signals] = min(best[signals], timeit.timeit(loop(signals), number=1))
    recorder.account = account
    return best[False] / steps * 1e6, best[True] / steps * 1e6


#: The parts of OTelMonitor's step path that the split times, none inside another: (part,
#: class, methods). Listeners are timed on the hooks they override (only those are called).
PARTS: list[tuple[str, type, tuple[str, ...]]] = [
    ("step clock", StepClock, ("end",)),
    ("outputs: item() reads (the wait for the step)", OTelMonitor, ("parse_outputs",)),
    ("time account", TimeAccount, ("step_begin", "step_end")),
    ("listener: live page history", HistoryRecorder, ("on_record", "on_nonfinite")),
    ("listener: actions engine (a nonfinite rule)", ActionEngine, ("on_step",)),
    ("listener: node link (mfotel-instrument)", NodeLink, ("on_step_begin", "on_step")),
]
REST = "the rest: hooks, MindSpore's counters, the contract's state"


class Split:
    """Times the parts of the step path (PARTS) inside a real training run: each method is
    wrapped on its class for the run and keeps its calls' durations. A part's time holds its
    wrapper's clock read; the wrappers' calls land in the rest, which `part_split` measures
    in untimed runs of the same monitor."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = {name: [] for name, _, _ in PARTS}
        self._saved: list[tuple[type, str, Any]] = []

    def __enter__(self) -> Split:
        for name, owner, methods in PARTS:
            for method in methods:
                self._saved.append((owner, method, owner.__dict__[method]))
                setattr(owner, method, self._timed(self.calls[name], owner.__dict__[method]))
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, method, original in reversed(self._saved):
            setattr(owner, method, original)
        self._saved.clear()

    @staticmethod
    def _timed(calls: list[float], method: Callable[..., Any]) -> Callable[..., Any]:
        perf = time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = perf()
            try:
                return method(*args, **kwargs)
            finally:
                calls.append(perf() - started)
        return timed

    def per_step(self, steps: int) -> dict[str, float]:
        """us per step of each part: the median call times the calls a step."""
        return {name: statistics.median(times) * len(times) / steps * 1e6 if times else 0.0
                for name, times in self.calls.items()}


def split_monitor(interval: int) -> OTelMonitor:
    """The benchmark's monitor with every optional listener that runs per step: the live page
    (on by default), the actions engine (a rule for non-finite losses, which never fires
    here) and, under mfotel-instrument, the node link (its directory: MFOTEL_NODE_DIR)."""
    return OTelMonitor(step_interval=interval, metrics=ALL_METRICS, job_name="bench",
                       prometheus={"host": "127.0.0.1", "port": free_port(),
                                   "linger_seconds": 0},
                       output={"console": False}, actions={"nonfinite": {"action": "stop"}})


def part_split(steps: int, repeats: int) -> dict[int, dict[str, float]]:
    """us per step of each part (PARTS, and the rest) of the interval-1 and interval-50
    monitors with every listener (split_monitor): medians over `repeats` rounds, each round a
    timed and an untimed run of each, interleaved."""
    rounds: dict[int, list[dict[str, float]]] = {1: [], 50: []}
    with tempfile.TemporaryDirectory() as node_dir, open(os.devnull, "w") as devnull, \
            _environment(ENV_DIR, node_dir):
        for _ in range(repeats):
            for interval, done in rounds.items():
                with Split() as split, contextlib.redirect_stdout(devnull):
                    timed = train(steps, split_monitor(interval))
                parts = split.per_step(min(timed.steps, steps))
                with contextlib.redirect_stdout(devnull):
                    whole = train(steps, split_monitor(interval))
                count = min(whole.steps, steps)
                parts[REST] = statistics.median(whole.per_step[:count]) * 1e6 - sum(
                    parts.values())
                done.append(parts)
    return {interval: {part: statistics.median(r[part] for r in done) for part in done[0]}
            for interval, done in rounds.items()}


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--split-repeats", type=int, default=3,
                        help="runs of each monitor with its parts timed (0: no split)")
    args = parser.parse_args()
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    load = os.getloadavg()
    runs: dict[str, list[tuple[float, float, float, float]]] = {}  # cpu, median, mean, steps/s
    Timed.CLOCK_COST = _clock_cost()
    table = variants()
    monitors: dict[str, Callback | None] = {}
    with open(os.devnull, "w") as devnull:
        for _ in range(args.repeats):  # interleaved, so drift hits every variant alike
            for name, make in table.items():
                with contextlib.redirect_stdout(devnull):
                    timed = train(args.steps, make())
                count = min(timed.steps, args.steps)
                monitors[name] = timed.inner
                per_step = sorted(s * 1e6 for s in timed.per_step[:count])
                cpu_times = [s * 1e6 for s in timed.cpu_per_step[:count]]
                runs.setdefault(name, []).append((statistics.median(cpu_times),
                                                  statistics.median(per_step),
                                                  statistics.fmean(per_step),
                                                  timed.steps / timed.wall))
    monitor = monitors[OTEL_50]
    assert isinstance(monitor, OTelMonitor)
    without, with_signals = job_signal_cost(monitor)
    cpu = {n: statistics.median(r[0] for r in rs) for n, rs in runs.items()}
    med = {n: statistics.median(r[1] for r in rs) for n, rs in runs.items()}
    mean = {n: statistics.median(r[2] for r in rs) for n, rs in runs.items()}
    sps = {n: statistics.median(r[3] for r in rs) for n, rs in runs.items()}
    print(f"steps per run: {args.steps}, repeats: {args.repeats} (interleaved; medians), "
          f"load average before: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}, "
          f"after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"{'variant':42} {'median us':>10} {'mean us':>9} {'x floor':>8} {'CPU us':>7} "
          f"{'x floor':>8} {'steps/s':>8}")
    for name in table:
        print(f"{name:42} {med[name]:10.1f} {mean[name]:9.1f} {med[name] / med[FLOOR]:8.2f} "
              f"{cpu[name]:7.1f} {cpu[name] / cpu[FLOOR]:8.2f} {sps[name]:8.0f}")
    print()
    head = "goal (issues 20, 34): median of the repeats' ratios (range)"
    print(f"{head:66} {'wall':>6} {'CPU':>6} {'goal':>6}")
    goals = [("per-step path: OTelMonitor interval 50 / read floor", OTEL_50, FLOOR, 1.2),
             ("record step: OTelMonitor interval 1, console off / prometheus_client",
              OTEL_1, PROM, 1.2),
             ("console: OTelMonitor interval 1, console on / LossMonitor", OTEL_1_CONSOLE,
              LOSS_MONITOR, 1.0)]
    for what, mine, base, goal in goals:
        # each repeat's two runs were neighbours in time: their ratio cancels the load of
        # that moment, and the median of the ratios the odd repeat
        walls = [a[1] / b[1] for a, b in zip(runs[mine], runs[base], strict=True)]
        used = [a[0] / b[0] for a, b in zip(runs[mine], runs[base], strict=True)]
        wall, cpu_ratio = statistics.median(walls), statistics.median(used)
        print(f"{what:66} {wall:5.2f}x {cpu_ratio:5.2f}x {goal:5.1f}x "
              f"{'met' if max(wall, cpu_ratio) <= goal else 'NOT met'}  (wall {min(walls):.2f}"
              f"-{max(walls):.2f}, CPU {min(used):.2f}-{max(used):.2f})")
    line = statistics.median(a[1] - b[1] for a, b in zip(runs[OTEL_1_CONSOLE], runs[OTEL_1],
                                                         strict=True))
    what = "console line on the training thread (console on - off, paired), wall"
    print(f"{what:66} {line:5.1f} us "
          f"(LossMonitor's whole step: {med[LOSS_MONITOR]:.1f} us)")
    added = with_signals - without
    print(f"{'job-level signals (outside time, step-begin timestamp) per step':66} "
          f"{added:5.2f} us (step clock and state: {without:.2f} -> {with_signals:.2f} us; "
          f"goal <= 2 us: {'met' if added <= 2 else 'NOT met'})")
    if args.split_repeats:
        print_split(part_split(args.steps, args.split_repeats), args.split_repeats)
    return 0


def print_split(split: dict[int, dict[str, float]], repeats: int) -> None:
    print()
    print(f"per-part split of OTelMonitor with every per-step listener, us per step (medians "
          f"of {repeats} rounds; a part's timing adds its clock read, ~0.1 us):")
    print(f"{'part':60} {'interval 1':>11} {'interval 50':>12}")
    for part in split[1]:
        print(f"{part:60} {split[1][part]:11.2f} {split[50][part]:12.2f}")
    print(f"{'the whole step (untimed runs of the same monitor)':60} "
          f"{sum(split[1].values()):11.2f} {sum(split[50].values()):12.2f}")


if __name__ == "__main__":
    sys.exit(main())
