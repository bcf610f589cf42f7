"""What loading a YAML costs, measured in a separate process (CPU seconds and peak memory).

    with CostMeter() as meter:
        cost = meter.load(path)   # Cost(cpu_seconds, peak_bytes, refused, message)

The worker process loads each file with `mfotel.config.load_config` three times: twice plain,
timed with `time.process_time` (CPU time, the less of two: the machine's load inflates it far
less than wall time), once under `tracemalloc` for the peak of what Python allocated (PyYAML's
nodes and values).
Its address space is capped (RLIMIT_AS) so that a regression fails the test instead of
swapping the machine.
"""
from __future__ import annotations

import json
import select
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

WORKER = r"""
import json, resource, sys, time, tracemalloc
from mfotel.config import ConfigError, load_config
with open("/proc/self/status") as status:
    vm = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmPeak:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + int(sys.argv[1]), vm + int(sys.argv[1])))
print("ready", flush=True)
for line in sys.stdin:
    path = json.loads(line)
    def load():
        try:
            load_config(path)
            return False, ""
        except ConfigError as exc:
            return True, str(exc).splitlines()[0][:300]
    cpu = float("inf")
    for _ in range(2):   # the less disturbed of two runs (other processes share the caches)
        started = time.process_time()
        refused, message = load()
        cpu = min(cpu, time.process_time() - started)
    tracemalloc.start()
    load()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(json.dumps([cpu, peak, refused, message]), flush=True)
"""


HANG_SECONDS = 120


@dataclass(frozen=True)
class Cost:
    cpu_seconds: float
    peak_bytes: int
    refused: bool
    message: str


class CostMeter:
    """A worker process measuring `load_config`; `headroom_bytes` caps its address space."""

    def __init__(self, headroom_bytes: int = 512 * 2**20) -> None:
        self.headroom = headroom_bytes
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> CostMeter:
        self.process = subprocess.Popen([sys.executable, "-c", WORKER, str(self.headroom)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        assert self.process.stdout.readline().strip() == "ready"
        return self

    def load(self, path: Path) -> Cost:
        assert self.process is not None and self.process.stdin and self.process.stdout
        self.process.stdin.write(json.dumps(str(path)) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], HANG_SECONDS)
        assert ready, f"loading {path} took more than {HANG_SECONDS} s"
        reply = self.process.stdout.readline()
        assert reply, f"the worker died on {path} (memory cap: {self.headroom} bytes)"
        cpu, peak, refused, message = json.loads(reply)
        return Cost(cpu, peak, refused, message)

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.stdin.close()   # type: ignore[union-attr]
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
