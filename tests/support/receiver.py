"""Helpers of the alerts-receiver tests: start the real CLI, post over real sockets,
certificates."""
from __future__ import annotations

import os
import ssl
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support import http
from tests.support.http import bearer
from tests.support.paths import ROOT

#: The issue's forged webhook: the smallest body that used to stop a healthy run.
FORGED = {"alerts": [{"status": "firing", "labels": {"alertname": "MindFormersLossNotFinite",
                                                     "job_name": "victim"}}]}


def notification(job: str = "victim", status: str = "firing", rank: str = "0",
                 starts_at: str = "2025-01-01T00:00:00Z", **annotations: str) -> dict:
    """An Alertmanager 0.25 (version 4) body with one MindFormersLossNotFinite alert."""
    labels = {"alertname": "MindFormersLossNotFinite", "severity": "critical",
              "job_name": job, "rank": rank}
    return {"version": "4", "status": status, "receiver": "mfotel-pager", "groupKey": "k",
            "alerts": [{"status": status, "labels": labels,
                        "annotations": annotations or {"summary": "Training loss is NaN or Inf."},
                        "startsAt": starts_at, "endsAt": "0001-01-01T00:00:00Z",
                        "fingerprint": f"fp{job}{rank}"}]}


def post(url: str, body: bytes | dict, headers: dict[str, str] | None = None,
         token: str | None = None, context: ssl.SSLContext | None = None,
         timeout: float = 10.0) -> tuple[int, str]:
    """(status, body text) of a POST (a dict is sent as JSON); raises only when no HTTP answer
    came back."""
    sent = {"Content-Type": "application/json", **(headers or {})}
    reply = http.post(url, body, headers=sent, auth=bearer(token) if token else None,
                      context=context, timeout=timeout)
    return reply.status, reply.text


def get(url: str, token: str | None = None, context: ssl.SSLContext | None = None
        ) -> tuple[int, str]:
    reply = http.get(url, auth=bearer(token) if token else None, context=context)
    return reply.status, reply.text


class _Lines:
    """The lines of a child's pipe, collected by a thread (a select() on the pipe would miss
    lines already in the text wrapper's buffer)."""

    def __init__(self, stream: Any) -> None:
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream: Any) -> None:
        for line in stream:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()

    def wait(self, count: int, timeout: float = 60.0) -> list[str]:
        """The first `count` lines (fewer if they do not come within `timeout` s)."""
        with self._cond:
            self._cond.wait_for(lambda: len(self.lines) >= count or not self._thread.is_alive(),
                                timeout)
            return self.lines[:count]

    def text(self) -> str:
        self._thread.join(30)
        return "".join(self.lines)


@dataclass
class CliReceiver:
    """`mfotel alerts-receiver` running as a child process."""

    process: subprocess.Popen
    url: str
    banner: list[str]                 # stderr lines printed at start
    _out: _Lines
    _err: _Lines

    def stderr_so_far(self) -> str:
        return "".join(self._err.lines)

    def stop(self) -> tuple[str, str]:
        """Terminate; (stdout, stderr) of the whole run."""
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)
        return self._out.text(), self._err.text()


def receiver_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "mfotel", "alerts-receiver", *args]


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFOTEL_RECEIVER_")}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.update(extra)
    return env


def start_receiver(*args: str, env: dict[str, str] | None = None,
                   banner_lines: int = 2) -> CliReceiver:
    """Start the CLI on a port the kernel picks (`--port 0`: a port picked free beforehand can
    be taken before the CLI binds it); returns once it listens (AssertionError if it does not)."""
    process = subprocess.Popen(receiver_command("--port", "0", *args), cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=child_env(**(env or {})))
    out, err = _Lines(process.stdout), _Lines(process.stderr)
    banner = err.wait(banner_lines)
    if not banner or "listening on" not in banner[0]:
        process.kill()
        process.wait(30)
        raise AssertionError(f"the receiver did not start: {err.text()}")
    url = banner[0].split("listening on ", 1)[1].split()[0]
    return CliReceiver(process, url, banner, out, err)


def make_certs(directory: Path, name: str = "server", ca: tuple[Path, Path] | None = None
               ) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (self-signed, or signed by `ca`), made by openssl."""
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    if ca is None:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                        "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
                        "-subj", f"/CN={name}", "-addext", "subjectAltName=IP:127.0.0.1",
                        "-keyout", str(key), "-out", str(cert)],
                       check=True, capture_output=True, timeout=60)
        return cert, key
    csr = directory / f"{name}.csr"
    subprocess.run(["openssl", "req", "-new", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-subj", f"/CN={name}",
                    "-keyout", str(key), "-out", str(csr)],
                   check=True, capture_output=True, timeout=60)
    subprocess.run(["openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca[0]),
                    "-CAkey", str(ca[1]), "-CAcreateserial", "-days", "1", "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key
