"""Training throughput while /metrics is attacked, against the unattacked run, in one run; and
the alerts receiver under the same floods.

    .venv/bin/python benchmarks/endpoint_attack.py [--steps 6000] [--repeats 2] [--part all]

The demo network (real MindSpore, CPU, graph mode) trains with OTelMonitor serving /metrics
behind basic auth (bcrypt cost 10) and default limits, while a legitimate scraper with the right
password scrapes every second. Scenarios, interleaved `--repeats` times (medians reported):

- unattacked;
- connection flood: 1000 idle connections held open (re-opened as the server closes them) and
  a burst of 100 new connections every second, from one address;
- the same flood from 40 addresses (127.0.1.1-40: no address holds more than 25);
- (receiver only) 16 idle connections from one address, re-opened as closed: the attack that
  made every webhook of the threaded receiver (16 slots) get 503;
- auth failures at 15/s: one client sending wrong passwords 15 times a second;
- auth-failure loop: 4 clients sending wrong passwords as fast as they are answered.

Attackers and the scraper are another process, as they would be on a network; the attackers
connect from 127.0.0.1, the scraper from 127.0.0.2. On a shared machine the attackers' own CPU
use slows training too; "endpoint CPU" (CPU time of the endpoint's threads per second of
training, bcrypt included) is what the attack costs the training process itself. Printed: steps/s
and its ratio to the unattacked run, the trainer's most threads and descriptors, the attack's
request rate and answers, and the legitimate scrapes that succeeded.

The receiver part runs the real `mfotel alerts-receiver` (bearer token, default limits) as a
child process, floods it as above for `--seconds`, while a legitimate client posts Alertmanager's
webhook with the token every second (one attempt each, 10 s timeout). Printed: webhooks
answered 200 and printed, the slowest, and the receiver's CPU, most threads and descriptors.
Set PYTHONPATH to another checkout to measure its receiver (e.g. the previous release).
"""
from __future__ import annotations

import argparse
import base64
import collections
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

PASSWORD = "right-password"
SCENARIOS = ("unattacked", "connection flood", "flood, 40 addresses", "auth failures, 15/s",
             "auth-failure loop")
RECEIVER_SCENARIOS = ("unattacked", "16 idle, re-opened", "connection flood",
                      "flood, 40 addresses")
ATTACKER, SCRAPER = "127.0.0.1", "127.0.0.2"  # a network's two hosts, on loopback
FLOODERS = [f"127.0.1.{i}" for i in range(1, 41)]
TOKEN = "bench-receiver-token"


# ---------------------------------------------------------------- the attacker process
def _get(port: int, password: str, source: str = ATTACKER, timeout: float = 10.0) -> int:
    token = base64.b64encode(f"prometheus:{password}".encode()).decode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout,
                                      source_address=(source, 0))
    try:
        conn.request("GET", "/metrics", headers={"Authorization": f"Basic {token}"})
        response = conn.getresponse()
        response.read()
        return response.status
    except OSError:
        return 0
    finally:
        conn.close()


def _post(port: int, index: int, timeout: float = 10.0) -> int:
    """Alertmanager 0.25's webhook body for one firing alert, with the bearer token."""
    alert = {"status": "firing", "labels": {"alertname": "MindFormersLossNotFinite",
                                            "severity": "critical", "job_name": f"bench-{index}",
                                            "rank": "0"},
             "annotations": {"summary": "Training loss is NaN or Inf."},
             "startsAt": "2025-01-01T00:00:00Z", "endsAt": "0001-01-01T00:00:00Z",
             "generatorURL": "http://127.0.0.1:9090/graph", "fingerprint": f"fp{index}"}
    body = json.dumps({"version": "4", "status": "firing", "receiver": "mfotel-pager",
                       "groupKey": f"bench-{index}", "alerts": [alert]}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout,
                                      source_address=(SCRAPER, 0))
    try:
        conn.request("POST", "/alerts", body, {"Authorization": f"Bearer {TOKEN}",
                                               "Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        return response.status
    except OSError:
        return 0
    finally:
        conn.close()


def _scraper(port: int, stop: threading.Event, results: dict, target: str) -> None:
    """The legitimate client, once a second, 10 s timeout: Prometheus scraping /metrics, or
    Alertmanager posting a webhook to the receiver."""
    count = 0
    while not stop.wait(1.0):
        started, wall = time.perf_counter(), time.time()
        count += 1
        status = _get(port, PASSWORD, SCRAPER) if target == "metrics" else _post(port, count)
        results["scrapes"].append((status, time.perf_counter() - started, wall))


def _flood(port: int, stop: threading.Event, results: dict, sources: list[str],
           idle_count: int = 1000, burst: int = 100) -> None:
    def connect(index: int) -> socket.socket:
        sock = socket.socket()
        sock.setblocking(False)
        sock.bind((sources[index % len(sources)], 0))
        sock.connect_ex(("127.0.0.1", port))
        return sock

    idle = [connect(i) for i in range(idle_count)]
    last_burst = 0.0
    while not stop.wait(0.1):
        for i, sock in enumerate(idle):
            try:
                closed = sock.recv(1, socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                closed = False
            except OSError:
                closed = True
            if closed:
                sock.close()
                idle[i] = connect(i)
                results["reopened"] += 1
        if time.monotonic() - last_burst >= 1.0:
            last_burst = time.monotonic()
            for i in range(burst):
                connect(i).close()
                results["burst"] += 1
    for sock in idle:
        sock.close()


def _auth_loop(port: int, stop: threading.Event, results: dict, interval: float = 0.0) -> None:
    count = 0
    while not stop.wait(interval):
        count += 1
        results["answers"][_get(port, f"guess-{threading.get_ident()}-{count}")] += 1


def attacker(port: int, scenario: str, target: str = "metrics") -> None:
    """Run `scenario` against 127.0.0.1:port until stdin closes; print a JSON summary."""
    stop = threading.Event()
    results: dict[str, Any] = {"scrapes": [], "reopened": 0, "burst": 0,
                               "answers": collections.Counter()}
    threads = [threading.Thread(target=_scraper, args=(port, stop, results, target),
                                daemon=True)]
    if scenario in ("connection flood", "flood, 40 addresses"):
        sources = [ATTACKER] if scenario == "connection flood" else FLOODERS
        threads.append(threading.Thread(target=_flood, args=(port, stop, results, sources),
                                        daemon=True))
    elif scenario == "16 idle, re-opened":  # the attack that silenced the threaded receiver
        threads.append(threading.Thread(target=_flood, args=(port, stop, results, [ATTACKER],
                                                             16, 0), daemon=True))
    elif scenario == "auth-failure loop":
        threads += [threading.Thread(target=_auth_loop, args=(port, stop, results), daemon=True)
                    for _ in range(4)]
    elif scenario == "auth failures, 15/s":  # the rate that cut training by 70% before limits
        threads.append(threading.Thread(target=_auth_loop, args=(port, stop, results, 1 / 15),
                                        daemon=True))
    started = time.monotonic()
    for thread in threads:
        thread.start()
    sys.stdin.read()
    stop.set()
    for thread in threads:
        thread.join(15)
    results["seconds"] = time.monotonic() - started
    results["answers"] = dict(results["answers"])
    print(json.dumps(results), flush=True)


# ---------------------------------------------------------------- the trainer (this process)
class Sampler:
    """This process's most threads and open descriptors, and the CPU seconds of the endpoint's
    threads (mfotel-metrics*: event loop and workers), sampled every 0.2 s."""

    def __init__(self) -> None:
        self.threads = self.fds = 0
        self._cpu: dict[int, float] = {}  # endpoint thread id -> its CPU seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def endpoint_cpu(self) -> float:
        return sum(self._cpu.values())

    def _run(self) -> None:
        ticks = os.sysconf("SC_CLK_TCK")
        while not self._stop.wait(0.2):
            self.threads = max(self.threads, threading.active_count())
            self.fds = max(self.fds, len(os.listdir("/proc/self/fd")))
            for thread in threading.enumerate():
                if thread.name.startswith("mfotel-metrics") and thread.native_id:
                    try:
                        fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text()
                    except OSError:
                        continue
                    utime, stime = fields.rsplit(")", 1)[1].split()[11:13]
                    self._cpu[thread.native_id] = (int(utime) + int(stime)) / ticks

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def web_config(folder: Path) -> Path:
    import bcrypt
    path = folder / "web.yml"
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=10)).decode()
    path.write_text(f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    return path


def train(steps: int, scenario: str, web: Path) -> dict[str, Any]:
    from mfotel.demo.training import run_demo
    from mfotel.localstack.servers import free_port
    port = free_port()
    result: dict[str, Any] = {}

    from mindspore.train import Callback

    class StartAttack(Callback):
        """Starts the attacker once the endpoint is up (first step) and times from there."""

        def on_train_step_end(self, run_context: Any) -> None:
            result["last_step"] = time.time()   # scrapes after training ended do not count
            if "attack" not in result:
                result["attack"] = subprocess.Popen(
                    [sys.executable, __file__, "--attack", scenario, "--port", str(port)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                time.sleep(1.0)  # the attack is under way before timing starts
                result["started"] = (time.perf_counter(),
                                     int(run_context.original_args().cur_step_num))

    with Sampler() as sampler:
        run_demo(steps=steps, port=port, lr_schedule="constant", output={"console": False},
                 prometheus={"web_config_file": str(web), "linger_seconds": 0},
                 extra_callbacks=(StartAttack(),))
        elapsed = time.perf_counter() - result["started"][0]
    attack = result["attack"]
    summary = json.loads(attack.communicate(timeout=60)[0])
    scrapes = [(status, seconds) for status, seconds, wall in summary["scrapes"]
               if wall < result["last_step"]]
    return {"steps_per_second": (steps - result["started"][1]) / elapsed,
            "threads": sampler.threads, "fds": sampler.fds,
            "endpoint_cpu": sampler.endpoint_cpu / elapsed,
            "scrapes_ok": sum(1 for s, _ in scrapes if s == 200), "scrapes": len(scrapes),
            "slowest_scrape": max((t for _, t in scrapes), default=0.0),
            "answers": summary["answers"], "reopened": summary["reopened"],
            "burst": summary["burst"], "seconds": summary["seconds"]}


# ---------------------------------------------------------------- the alerts receiver
def _proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def receive(scenario: str, seconds: float, folder: Path) -> dict[str, Any]:
    """The real `mfotel alerts-receiver` (bearer token) under `scenario` for `seconds`."""
    from mfotel.localstack.servers import free_port
    port, token = free_port(), folder / "token"
    token.write_text(TOKEN)
    receiver = subprocess.Popen(
        [sys.executable, "-m", "mfotel", "alerts-receiver", "--port", str(port),
         "--bearer-token-file", str(token)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, cwd=folder,  # not this checkout's folder: `-m` imports from the cwd first
        env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", ROOT)})
    try:
        assert receiver.stderr is not None
        assert "listening on" in receiver.stderr.readline(), "the receiver did not start"
        started_cpu, threads, fds = _proc_cpu(receiver.pid), 0, 0
        attack = subprocess.Popen([sys.executable, __file__, "--attack", scenario, "--port",
                                   str(port), "--target", "receiver"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            threads = max(threads, int(next(
                line.split()[1] for line in Path(f"/proc/{receiver.pid}/status").read_text()
                .splitlines() if line.startswith("Threads:"))))
            fds = max(fds, len(os.listdir(f"/proc/{receiver.pid}/fd")))
            time.sleep(0.2)
        cpu = (_proc_cpu(receiver.pid) - started_cpu) / seconds
        summary = json.loads(attack.communicate("", timeout=60)[0])
    finally:
        receiver.terminate()
        out, _ = receiver.communicate(timeout=30)
    posts = summary["scrapes"]
    return {"ok": sum(1 for status, _, _ in posts if status == 200), "posts": len(posts),
            "printed": out.count("[FIRING critical] MindFormersLossNotFinite"),
            "slowest": max((t for _, t, _ in posts), default=0.0), "cpu": cpu,
            "threads": threads, "fds": fds, "reopened": summary["reopened"],
            "burst": summary["burst"], "seconds": summary["seconds"]}


def _attack_rate(result: dict[str, Any]) -> str:
    return (f"{result['burst'] / result['seconds']:.0f} new conn/s + "
            f"{result['reopened'] / result['seconds']:.0f} idle re-opened/s")


def report_receiver(seconds: float) -> None:
    with tempfile.TemporaryDirectory() as folder:
        results = {name: receive(name, seconds, Path(folder)) for name in RECEIVER_SCENARIOS}
    print(f"\n## the alerts receiver under attack: {seconds:g} s each, bearer token, default "
          "limits, one webhook a second from another address")
    print(f"{'scenario':20} {'webhooks 200':>12} {'printed':>7} {'slowest':>8} {'CPU':>6} "
          f"{'threads':>7} {'fds':>4}  attack")
    for name, r in results.items():
        attack = _attack_rate(r) if name != "unattacked" else ""
        print(f"{name:20} {r['ok']:>5}/{r['posts']:<6} {r['printed']:7d} {r['slowest']:7.3f}s "
              f"{100 * r['cpu']:5.1f}% {r['threads']:7d} {r['fds']:4d}  {attack}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=20.0,
                        help="length of each receiver scenario")
    parser.add_argument("--part", choices=("all", "metrics", "receiver"), default="all")
    parser.add_argument("--attack", choices=SCENARIOS + RECEIVER_SCENARIOS,
                        help=argparse.SUPPRESS)
    parser.add_argument("--target", choices=("metrics", "receiver"), default="metrics",
                        help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.attack:
        attacker(args.port, args.attack, args.target)
        return 0
    if args.part in ("all", "metrics"):
        report_training(args.steps, args.repeats)
    if args.part in ("all", "receiver"):
        report_receiver(args.seconds)
    return 0


def report_training(steps: int, repeats: int) -> None:
    import mindspore as ms
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    runs: dict[str, list[dict]] = {name: [] for name in SCENARIOS}
    with tempfile.TemporaryDirectory() as folder:
        web = web_config(Path(folder))
        for _ in range(repeats):
            for name in SCENARIOS:
                runs[name].append(train(steps, name, web))
    print(f"## training while /metrics is attacked: {steps} steps, basic auth (bcrypt cost 10),"
          f" default limits; medians of {repeats}")
    base = statistics.median(r["steps_per_second"] for r in runs["unattacked"])
    print(f"{'scenario':20} {'steps/s':>8} {'ratio':>6} {'endpoint CPU':>12} {'threads':>7} "
          f"{'fds':>4} {'legit scrapes ok':>16} {'slowest':>8}  attack")
    for name, results in runs.items():
        sps = statistics.median(r["steps_per_second"] for r in results)
        last = results[-1]
        ok = f"{sum(r['scrapes_ok'] for r in results)}/{sum(r['scrapes'] for r in results)}"
        attack = ""
        if "flood" in name:
            attack = _attack_rate(last)
        elif name.startswith("auth"):
            answers = last["answers"]
            attack = (f"{sum(answers.values()) / last['seconds']:.0f} wrong-password req/s, "
                      "answers " + ", ".join(f"{k}: {v}" for k, v in sorted(answers.items())))
        cpu = statistics.median(r["endpoint_cpu"] for r in results)
        print(f"{name:20} {sps:8.0f} {sps / base:6.3f} {100 * cpu:11.1f}% "
              f"{max(r['threads'] for r in results):7d} "
              f"{max(r['fds'] for r in results):4d} {ok:>16} "
              f"{max(r['slowest_scrape'] for r in results):7.3f}s  {attack}")


if __name__ == "__main__":
    sys.exit(main())
