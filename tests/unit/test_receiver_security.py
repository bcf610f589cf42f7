"""The alerts receiver's control plane over real sockets: who may act, and what no request can do.

The receiver runs as the real `mfotel alerts-receiver` child process (or in-process where a
test counts its threads); clients are real HTTP(S) clients. Alertmanager itself sending the
credentials is in tests/e2e/test_receiver_alertmanager.py.
"""
from __future__ import annotations

import base64
import io
import json
import os
import socket
import ssl
import threading
from pathlib import Path

import pytest

from mfotel.actions.control import CONTROL_FILE, AlertControl
from mfotel.alerting import receiver as receiver_module
from mfotel.alerting.receiver import AlertsReceiver
from mfotel.endpoint.auth import Credentials
from mfotel.endpoint.webconfig import TlsConfig
from tests.support.hangs import bounded
from tests.support.receiver import (
    FORGED,
    get,
    make_certs,
    notification,
    post,
    receiver_command,
    start_receiver,
)
from tests.support.waiting import settle, wait_for

TOKEN = "rcv-token-" + os.urandom(6).hex()


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "receiver-token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def control_dir(tmp_path: Path) -> Path:
    """A control directory where the job `victim` uses the control channel."""
    (tmp_path / "ctl" / "victim").mkdir(parents=True)
    return tmp_path / "ctl"


@pytest.fixture
def receivers():
    """Start CLI receivers; every one is stopped at the end."""
    started = []

    def start(*args: str, **kwargs):
        receiver = start_receiver(*args, **kwargs)
        started.append(receiver)
        return receiver
    yield start
    for receiver in started:
        receiver.stop()


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


# ---------------------------------------------------------------- who may act
def test_a_receiver_that_acts_refuses_to_start_without_credentials(control_dir: Path) -> None:
    import subprocess

    from tests.support.receiver import child_env
    done = subprocess.run(receiver_command("--port", "0", "--control-dir", str(control_dir)),
                          capture_output=True, text=True, timeout=60, env=child_env())
    assert done.returncode == 2
    assert "refusing to act on alerts without authentication" in done.stderr
    assert "--bearer-token-file" in done.stderr and "--insecure-no-auth" in done.stderr
    assert "listening" not in done.stderr


def test_insecure_no_auth_must_be_explicit_and_is_warned_about(receivers, control_dir: Path
                                                               ) -> None:
    receiver = receivers("--control-dir", str(control_dir), "--insecure-no-auth")
    assert "WARNING: --insecure-no-auth" in receiver.banner[1]
    assert post(receiver.url, FORGED)[0] == 200       # what the operator asked for
    assert (control_dir / "victim" / CONTROL_FILE).exists()


def test_a_print_only_receiver_runs_without_auth_and_says_so(receivers) -> None:
    receiver = receivers()
    assert "no authentication" in receiver.banner[1] and "only prints" in receiver.banner[1]
    assert post(receiver.url, notification())[0] == 200


def test_forged_webhooks_get_401_and_change_nothing(receivers, token_file: Path,
                                                    control_dir: Path) -> None:
    receiver = receivers("--control-dir", str(control_dir), "--bearer-token-file",
                         str(token_file))
    assert "requests must authenticate (Bearer)" in receiver.banner[1]
    forged_credentials = [{}, {"Authorization": "Bearer wrong"},
                          {"Authorization": f"Bearer {TOKEN}x"},
                          {"Authorization": f"Bearer {TOKEN[:-1]}"},
                          {"Authorization": TOKEN}, basic("alertmanager", TOKEN)]
    for headers in forged_credentials:
        for _ in range(10):   # ten fire/resolve pairs once scaled the lr by 2^-10
            for status in ("firing", "resolved"):
                code, text = post(receiver.url, notification(status=status), headers)
                assert (code, text) == (401, "missing or wrong credentials\n"), headers
        assert post(receiver.url, FORGED, headers)[0] == 401
    # a 15 MB body without credentials is read and dropped: the client gets its 401
    assert post(receiver.url, b" " * 15_000_000, timeout=60)[0] == 401
    assert list((control_dir / "victim").iterdir()) == []
    assert get(receiver.url)[0] == 401                 # nor can it read what was received

    assert post(receiver.url, FORGED, token=TOKEN)[0] == 200
    request = json.loads((control_dir / "victim" / CONTROL_FILE).read_text())
    assert (request["action"], request["source"]) == ("stop", "alert")
    code, text = get(receiver.url, token=TOKEN)
    assert code == 200 and [a["labels"]["job_name"] for a in json.loads(text)] == ["victim"]
    out, err = receiver.stop()
    assert out.count("[FIRING") == 1                   # only the authenticated one was printed
    assert "refused a request with 401 from 127.0.0.1: missing or wrong credentials" in err
    assert err.count("refused a request") == 1   # once a minute, not once per request


def test_credentials_in_clear_text_or_a_readable_secret_are_warned_about(receivers,
                                                                          token_file: Path
                                                                          ) -> None:
    token_file.chmod(0o644)
    receiver = receivers("--host", "0.0.0.0", "--bearer-token-file", str(token_file),
                         banner_lines=4)
    assert receiver.banner[1:] == [
        "mfotel alerts-receiver: requests must authenticate (Bearer)\n",
        f"mfotel alerts-receiver: WARNING: {token_file} is readable by other users; "
        f"chmod 600 it\n",
        "mfotel alerts-receiver: WARNING: credentials cross the network in clear text on "
        "0.0.0.0; add --tls-cert-file and --tls-key-file\n"]


@pytest.mark.parametrize("source", ["file", "environment"])
def test_basic_auth_password_from_a_file_or_the_environment(receivers, tmp_path: Path,
                                                            control_dir: Path, source) -> None:
    password = "pw-" + os.urandom(6).hex()
    if source == "file":
        (tmp_path / "pw").write_text(password)
        args, env = ("--basic-auth-password-file", str(tmp_path / "pw")), {}
    else:
        args, env = (), {"MFOTEL_RECEIVER_BASIC_AUTH_PASSWORD": password}
    receiver = receivers("--control-dir", str(control_dir), "--basic-auth-username",
                         "alertmanager", *args, env=env)
    assert post(receiver.url, FORGED, basic("alertmanager", "wrong"))[0] == 401
    assert post(receiver.url, FORGED, basic("prometheus", password))[0] == 401
    assert not (control_dir / "victim" / CONTROL_FILE).exists()
    assert post(receiver.url, FORGED, basic("alertmanager", password))[0] == 200
    assert (control_dir / "victim" / CONTROL_FILE).exists()


def test_secrets_appear_neither_in_ps_nor_in_the_output(receivers, control_dir: Path) -> None:
    receiver = receivers("--control-dir", str(control_dir),
                         env={"MFOTEL_RECEIVER_BEARER_TOKEN": TOKEN})
    cmdline = Path(f"/proc/{receiver.process.pid}/cmdline").read_bytes()
    assert TOKEN.encode() not in cmdline
    assert post(receiver.url, FORGED, {"Authorization": f"Bearer {TOKEN[:-2]}"})[0] == 401
    assert post(receiver.url, FORGED, token=TOKEN)[0] == 200
    out, err = receiver.stop()
    assert TOKEN not in out + err and TOKEN[:-2] not in out + err
    assert repr(Credentials(bearer_token=TOKEN.encode())) == "Credentials(bearer)"


@pytest.mark.parametrize("problem, words", [
    ("missing", "no such file"),
    ("empty", "the file is empty"),
    ("fifo", "is a FIFO (named pipe), not a regular file"),
    ("both", "both --bearer-token-file and $MFOTEL_RECEIVER_BEARER_TOKEN are set"),
])
def test_unusable_secrets_are_clear_errors_at_start(tmp_path: Path, control_dir: Path, problem,
                                                    words) -> None:
    import subprocess

    from tests.support.receiver import child_env
    path, env = tmp_path / "token", {}
    if problem == "empty":
        path.write_text("\n")
    elif problem == "fifo":
        os.mkfifo(path)           # would block an open() without O_NONBLOCK forever
    elif problem == "both":
        path.write_text(TOKEN)
        env["MFOTEL_RECEIVER_BEARER_TOKEN"] = TOKEN
    done = bounded(lambda: subprocess.run(
        receiver_command("--port", "0", "--control-dir", str(control_dir),
                         "--bearer-token-file", str(path)),
        capture_output=True, text=True, timeout=60, env=child_env(**env)), 90)
    assert done.returncode == 2 and words in done.stderr, done.stderr
    assert TOKEN not in done.stderr


# ---------------------------------------------------------------- floods and replays
@pytest.fixture
def acting_receiver(tmp_path: Path):
    """In-process receiver with a token, scaling the lr of job `victim` by 0.5 per action."""
    (tmp_path / "victim").mkdir()
    out = io.StringIO()
    control = AlertControl(str(tmp_path / "{job_name}"), ["MindFormersLossNotFinite"],
                           action="scale_lr", factor=0.5, out=out)
    with AlertsReceiver(port=0, out=out, err=io.StringIO(), control=control,
                        auth=Credentials(bearer_token=TOKEN.encode())) as receiver:
        receiver.test_out = out   # type: ignore[attr-defined]
        yield receiver


def test_a_flapping_alert_acts_at_most_max_actions_per_window(acting_receiver) -> None:
    for pair in range(10):
        starts = f"2025-01-01T00:{pair:02d}:00Z"    # ten genuine episodes, one after another
        for status in ("firing", "resolved"):
            assert post(acting_receiver.url, notification(status=status, starts_at=starts),
                        token=TOKEN)[0] == 200
    control = acting_receiver.control
    assert len(control.written) == 3 and control.refused == 7   # lr x 0.5^3 at worst, not 2^-10
    said = acting_receiver.test_out.getvalue()
    assert said.count("scale_lr requested for job victim") == 3
    assert said.count("not acting on MindFormersLossNotFinite for job victim: 3 actions in the "
                      "last 3600 s already (--control-max-actions 3)") == 7


def test_replayed_and_repeated_notifications_act_once(acting_receiver) -> None:
    firing = notification(rank="0")
    other_rank = notification(rank="1")
    for body in (firing, firing, other_rank, firing):          # repeats, and a second rank
        assert post(acting_receiver.url, body, token=TOKEN)[0] == 200
    for body in (notification(status="resolved", rank="0"),
                 notification(status="resolved", rank="1"), firing, other_rank):  # replays
        assert post(acting_receiver.url, body, token=TOKEN)[0] == 200
    assert len(acting_receiver.control.written) == 1


# ---------------------------------------------------------------- bad bodies
@pytest.fixture(scope="module")
def strict_receiver(tmp_path_factory):
    directory = tmp_path_factory.mktemp("strict")
    (directory / "token").write_text(TOKEN)
    (directory / "ctl" / "victim").mkdir(parents=True)
    receiver = start_receiver("--bearer-token-file", str(directory / "token"),
                              "--control-dir", str(directory / "ctl"))
    yield receiver
    receiver.stop()


def _alert(**fields) -> bytes:
    alert = {"status": "firing", "labels": {"alertname": "X", "job_name": "victim"}, **fields}
    return json.dumps({"alerts": [alert]}).encode()


BAD_BODIES = {
    "list-typed annotation": (_alert(annotations={"summary": ["a", "b"]}), 400,
                              "alerts[0].annotations.summary: a string, not list"),
    "100k-deep JSON": (b"[" * 100_000 + b"]" * 100_000, 400, "nested deeper than 16 levels"),
    "deep object": (b'{"alerts": [], "x": ' + b'{"a": ' * 500 + b"1" + b"}" * 501, 400,
                    "nested deeper than 16 levels"),
    "15 MB body": (b" " * 15_000_000, 413, "body of 15000000 bytes; at most 4194304"),
    "newline in a label": (_alert(labels={"alertname": "X\n[FIRING critical] Forged"}), 400,
                           "alerts[0].labels.alertname: control characters or line breaks"),
    "U+2028 in a label": (_alert(labels={"alertname": "X\u2028Y"}), 400, "line breaks"),
    "bad label name": (_alert(labels={"a-b": "x"}), 400, '"a-b" is not a label name'),
    "labels as a list": (_alert(labels=[["alertname", "X"]]), 400,
                         "alerts[0].labels: an object of strings, not list"),
    "5000-digit number": (b'{"alerts": [{"labels": {"rank": ' + b"9" * 5000 + b"}}]}", 400,
                          "the body is not JSON (Exceeds the limit"),
    "huge float label": (b'{"alerts": [{"labels": {"rank": 1e999}}]}', 400,
                         "alerts[0].labels.rank: a string, not number"),
    "unknown status": (_alert(status="exploded"), 400, '"exploded" is not firing or resolved'),
    "not UTF-8": (b'{"alerts": [{"labels": {"a": "\xff"}}]}', 400, "not UTF-8 (byte 30)"),
    "not JSON": (b"alerts=1", 400, "the body is not JSON"),
    "JSON list": (b"[]", 400, "a JSON list, not an object"),
    "no alerts": (b'{"status": "firing"}', 400, "no 'alerts' list"),
}


@pytest.mark.parametrize("case", BAD_BODIES)
def test_bad_bodies_are_answered_with_what_is_wrong(strict_receiver, case) -> None:
    body, code, words = BAD_BODIES[case]
    status, text = post(strict_receiver.url, body, token=TOKEN, timeout=60)  # always answered
    assert status == code and words in text, text
    assert text.count("\n") == 1 and len(text) < 700    # one short line, nothing echoed in bulk
    assert post(strict_receiver.url, notification(job="nobody"), token=TOKEN)[0] == 200


def test_bad_bodies_leave_no_traceback_and_print_nothing(receivers, token_file: Path,
                                                          control_dir: Path) -> None:
    receiver = receivers("--bearer-token-file", str(token_file), "--control-dir",
                         str(control_dir))
    for body, code, _ in BAD_BODIES.values():
        assert post(receiver.url, body, token=TOKEN, timeout=60)[0] == code
    assert receiver.process.poll() is None
    out, err = receiver.stop()
    assert out == "" and "Traceback" not in err and "Exception" not in err
    # one line per refusal kind and minute, not one per request
    assert err.count("refused a request with 400 from") == 1
    assert err.count("refused a request with 413 from") == 1
    assert list((control_dir / "victim").iterdir()) == []


def test_a_chunked_body_is_asked_for_a_content_length(strict_receiver) -> None:
    import http.client
    from urllib.parse import urlsplit
    url = urlsplit(strict_receiver.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    connection.request("POST", "/alerts", iter([json.dumps(FORGED).encode()]),
                       {"Authorization": f"Bearer {TOKEN}"}, encode_chunked=True)
    response = connection.getresponse()
    assert response.status == 411 and b"Content-Length" in response.read()
    connection.close()


def test_printed_lines_are_escaped_one_alert_one_line() -> None:
    out = io.StringIO()
    forged = ["ok\n[FIRING critical] MindFormersLossNotFinite job_name=prod rank=0: forged",
              "\x1b[2J\x1b[Hscreen wiped", "split\u2028here\rand\x85there"]
    body = {"alerts": [notification(summary=text)["alerts"][0] for text in forged]}
    with AlertsReceiver(port=0, out=out, verbose=True) as receiver:
        assert post(receiver.url, body)[0] == 200
    lines = out.getvalue().split("\n")[:-1]
    assert len(lines) == 3 and all(line.startswith("[FIRING critical] ") for line in lines)
    assert lines[0].endswith(r"ok\n[FIRING critical] MindFormersLossNotFinite "
                             r"job_name=prod rank=0: forged")
    assert lines[1].endswith(r"\x1b[2J\x1b[Hscreen wiped")
    assert lines[2].endswith(r"split\u2028here\rand\x85there")
    assert len(out.getvalue().splitlines()) == 3         # Python's idea of lines too


# ---------------------------------------------------------------- connections
def _idle(address: tuple[str, int], count: int) -> list[socket.socket]:
    return [socket.create_connection(address, timeout=10) for _ in range(count)]


def test_idle_connections_cannot_starve_the_receiver() -> None:
    with AlertsReceiver(port=0, out=None, err=None, max_connections=4,
                        request_seconds=4) as receiver:
        before = threading.active_count()
        idle = _idle(("127.0.0.1", receiver.port), 50)
        try:
            # no thread per connection, whatever the number of idle clients
            assert threading.active_count() <= before
            # while they are held, a post (from the same address) is served at once: it
            # takes the place of the oldest idle connection (before: 503 until they timed out)
            assert post(receiver.url, notification(), timeout=5)[0] == 200
            for sock in idle:     # every idle client was closed: none is left open
                sock.settimeout(10)
                assert sock.recv(1024) == b""
        finally:
            for sock in idle:
                sock.close()
        assert receiver.received() and receiver._server.evicted >= 46


def test_a_trickling_client_is_cut_off_at_the_request_deadline() -> None:
    with AlertsReceiver(port=0, out=None, err=None, request_seconds=1.0) as receiver:
        sock = socket.create_connection(("127.0.0.1", receiver.port), timeout=10)
        sock.sendall(b"POST /alerts HTTP/1.1\r\nHost: x\r\n")
        answer = b""

        def cut_off() -> bool:  # one header byte every 0.1 s, until the server closes
            try:
                sock.sendall(b"X")
            except OSError:
                return True
            return False
        # a timeout per read would keep this client forever: only a deadline cuts it
        wait_for(cut_off, settle(receiver.request_seconds), 0.1, "the trickle cut off")
        sock.settimeout(5)
        try:
            answer = sock.recv(1024)
        except OSError:
            pass
        sock.close()
        assert answer == b"" or answer.startswith(b"HTTP/1.0 408")


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    make_certs(directory, "server")
    ca = make_certs(directory, "client-ca")
    make_certs(directory, "client", ca=ca)
    return directory


def test_a_client_idling_in_the_tls_handshake_blocks_nobody(certs: Path) -> None:
    tls = TlsConfig(str(certs / "server.crt"), str(certs / "server.key")).context()
    client = ssl.create_default_context(cafile=str(certs / "server.crt"))
    with AlertsReceiver(port=0, out=None, err=None, tls=tls, request_seconds=60) as receiver:
        assert receiver.url.startswith("https://127.0.0.1:")
        idle = _idle(("127.0.0.1", receiver.port), 3)       # TCP open, no ClientHello
        try:
            # well before the idle clients' 60 s are up, a real client is served
            assert post(receiver.url, notification(), context=client, timeout=10)[0] == 200
        finally:
            for sock in idle:
                sock.close()


def test_mutual_tls_authenticates_a_receiver_that_acts(certs: Path, tmp_path: Path) -> None:
    (tmp_path / "victim").mkdir()
    tls = TlsConfig(str(certs / "server.crt"), str(certs / "server.key"),
                    "RequireAndVerifyClientCert", str(certs / "client-ca.crt")).context()
    control = AlertControl(str(tmp_path), ["MindFormersLossNotFinite"], out=None)
    without = ssl.create_default_context(cafile=str(certs / "server.crt"))
    with_cert = ssl.create_default_context(cafile=str(certs / "server.crt"))
    with_cert.load_cert_chain(str(certs / "client.crt"), str(certs / "client.key"))
    with AlertsReceiver(port=0, out=None, err=None, tls=tls, control=control) as receiver:
        with pytest.raises(OSError):            # no certificate: the handshake fails
            post(receiver.url, FORGED, context=without)
        assert not (tmp_path / "victim" / CONTROL_FILE).exists()
        assert post(receiver.url, FORGED, context=with_cert)[0] == 200
    assert control.written == [tmp_path / "victim" / CONTROL_FILE]


def test_memory_of_received_alerts_is_bounded(monkeypatch) -> None:
    monkeypatch.setattr(receiver_module, "KEEP_ALERTS", 5)
    with AlertsReceiver(port=0, out=None) as receiver:
        for rank in range(8):
            assert post(receiver.url, notification(rank=str(rank)))[0] == 200
    assert [a.labels["rank"] for a in receiver.received()] == ["3", "4", "5", "6", "7"]
    assert receiver.notifications == 8
