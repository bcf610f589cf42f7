"""Property tests of the control plane's readers of untrusted input (Hypothesis).

- The webhook handler, through real HTTP requests to a running receiver: every generated body
  (random JSON, Alertmanager-shaped bodies with wrong types, unicode, huge numbers, deep
  nesting, raw bytes) gets an answer, 200 or a 4xx whose one line names what is wrong; never a
  500, a dropped connection or a hang; a 200 prints exactly one line per alert.
- The control-file reader and the action engine, on generated file contents: a request, or a
  ValueError naming the field or the file; the engine never raises and counts what it ignores.
Each case runs under a time bound (the HTTP timeout, or `bounded`): a hang fails the test.
"""
from __future__ import annotations

import http.client
import io
import json
import re
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mfotel.actions.control import (
    CONTROL_FILE,
    SCHEDULE_FILE,
    AlertControl,
    FileWatch,
    Request,
    write_json_atomic,
)
from mfotel.actions.engine import ActionEngine
from mfotel.alerting.receiver import AlertsReceiver
from mfotel.alerting.webhook import PayloadError, decode_notification
from mfotel.config import parse_config
from mfotel.endpoint.auth import Credentials
from tests.support.hangs import bounded

TOKEN = "fuzz-token"
CASE_SECONDS = 30
#: A 400 starts with the field at fault (or says what the body is not) ...
WHERE = ("alerts[", "receiver: ", "groupKey: ", "status: ", "not an Alertmanager webhook payload: ",
         "the body is ", "JSON nested deeper than ")
#: ... and says what is wrong with it.
WHAT = ("a string, not ", "an object of strings, not ", "an object, not ", "is not a label name",
        "control characters or line breaks", "is not firing or resolved", "no 'alerts' list",
        "not an object", "nested deeper than", "is not UTF-8", "is not JSON", "is empty")


def names_the_problem(text: str) -> bool:
    return text.startswith(WHERE) and any(what in text for what in WHAT)

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-10**30, 10**30),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30))
json_values = st.recursive(scalars, lambda children: st.one_of(
    st.lists(children, max_size=4), st.dictionaries(st.text(max_size=10), children, max_size=4)),
    max_leaves=20)
label_names = st.one_of(st.sampled_from(["alertname", "job_name", "rank", "severity"]),
                        st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,10}", fullmatch=True),
                        st.text(max_size=10))
label_values = st.one_of(st.sampled_from(["MindFormersLossNotFinite", "fuzzjob", "0"]),
                         st.text(max_size=40), json_values)
alerts = st.fixed_dictionaries(
    {}, optional={"status": st.one_of(st.sampled_from(["firing", "resolved"]), json_values),
                  "labels": st.one_of(st.dictionaries(label_names, label_values, max_size=5),
                                      json_values),
                  "annotations": st.one_of(st.dictionaries(st.text(max_size=10),
                                                           st.text(max_size=60), max_size=3),
                                           json_values),
                  "startsAt": st.one_of(st.text(max_size=30), json_values),
                  "fingerprint": st.one_of(st.text(max_size=16), json_values)})
payloads = st.fixed_dictionaries(
    {"alerts": st.one_of(st.lists(alerts, max_size=4), json_values)},
    optional={"status": json_values, "receiver": json_values, "groupKey": json_values,
              "version": st.just("4"), "commonLabels": json_values})


def nested(depth: int, open_: bytes, close: bytes) -> bytes:
    return open_ * depth + b"1" + close * depth


bodies = st.one_of(
    payloads.map(lambda p: json.dumps(p).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=300),
    st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.integers(1, 200_000).map(lambda n: nested(n, b"[", b"]")),
    st.integers(1, 5_000).map(lambda n: b'{"alerts": [], "x": ' + nested(n, b'{"a": ', b"}")
                              + b"}"),
    st.integers(4300, 20_000).map(lambda n: b'{"alerts": [{"labels": {"rank": ' + b"7" * n
                                  + b"}}]}"),
)


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fuzz")
    (directory / "fuzzjob").mkdir()
    out, err = io.StringIO(), io.StringIO()
    control = AlertControl(str(directory / "{job_name}"), ["MindFormersLossNotFinite"], out=out)
    with AlertsReceiver(port=0, out=out, err=err, control=control,
                        auth=Credentials(bearer_token=TOKEN.encode())) as receiver:
        yield receiver, out, err


def post(port: int, body: bytes) -> tuple[int, str]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=CASE_SECONDS)
    try:
        connection.request("POST", "/alerts", body, {"Authorization": f"Bearer {TOKEN}",
                                                     "Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies)
def test_the_running_receiver_answers_every_generated_body(running, body: bytes) -> None:
    receiver, out, err = running
    lines_before = out.getvalue().count("\n")
    status, text = post(receiver.port, body)       # raises if the connection is dropped
    assert status in (200, 400), (status, text)
    if status == 400:
        assert text.endswith("\n") and text.count("\n") == 1 and names_the_problem(text), text
        assert out.getvalue().count("\n") == lines_before      # nothing printed
    else:
        count = len(json.loads(body)["alerts"])
        printed = out.getvalue().split("\n")[lines_before:-1]
        alert_lines = [line for line in printed if not line.startswith("mfotel alerts-receiver")]
        assert len(alert_lines) == count and all(line.startswith("[") for line in alert_lines)
    assert receiver.rejected[500] == 0 and "Traceback" not in err.getvalue()


@settings(max_examples=1000, deadline=None)
@given(body=bodies)
def test_decoding_any_body_gives_alerts_or_a_payload_error(body: bytes) -> None:
    try:
        alerts = bounded(lambda: decode_notification(body), CASE_SECONDS)
    except PayloadError as error:
        assert names_the_problem(str(error)), str(error)
        return
    for alert in alerts:
        assert alert.line().isprintable()


# ---------------------------------------------------------------- control files
#: Integers too large for a float (and to print, near 4300 digits), of either sign.
huge_ints = st.builds(lambda digits, sign: sign * 10 ** digits, st.integers(300, 4200),
                      st.sampled_from([1, -1]))
request_fields = st.fixed_dictionaries(
    {}, optional={"id": st.one_of(st.uuids().map(lambda u: u.hex[:12]), json_values),
                  "action": st.one_of(st.sampled_from(["stop", "scale_lr", "warn"]), json_values),
                  "factor": st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                                      st.integers(), huge_ints, json_values),
                  "source": st.one_of(st.sampled_from(["control", "alert", "plateau"]),
                                      json_values),
                  "reason": st.one_of(st.text(max_size=50), json_values),
                  "created": st.one_of(st.floats(), st.integers(), huge_ints, json_values),
                  "step": st.one_of(st.integers(), huge_ints, json_values)})
file_contents = st.one_of(
    request_fields.map(lambda r: json.dumps(r).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=300),
    st.integers(1, 100_000).map(lambda n: nested(n, b"[", b"]")),
)
FIELD_PROBLEMS = re.compile(r"^(the request has no id|id |"
                            r"reason: |created \(unix seconds\): |action |scale_lr needs a "
                            r"positive factor|source |step )")


@settings(max_examples=500, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=file_contents)
def test_the_control_file_reader_gives_a_request_or_names_the_problem(tmp_path: Path,
                                                                      content: bytes) -> None:
    path = tmp_path / f"{uuid.uuid4().hex}.json"
    path.write_bytes(content)
    try:
        changed, data = bounded(FileWatch(path).poll, CASE_SECONDS)
    except ValueError as error:
        assert str(path) in str(error)
        assert any(what in str(error) for what in ("not valid JSON", "not a JSON object",
                                                   "is larger than")), str(error)
        return
    assert changed
    try:
        request = Request.from_json(data)
    except ValueError as error:
        assert FIELD_PROBLEMS.match(str(error)), str(error)
        return
    assert request.action in ("stop", "scale_lr", "warn") and request.describe().isprintable()


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(control=file_contents, schedule=file_contents)
def test_the_engine_never_raises_on_generated_control_files(tmp_path: Path, control: bytes,
                                                            schedule: bytes) -> None:
    """Rank 0 reads control.json, rank 1 schedule.json; whatever they hold, a step ends, and
    what cannot be used is counted."""
    root = tmp_path / uuid.uuid4().hex
    cfg = parse_config({"actions": {"control_dir": str(root / "{job_name}")}}).actions
    rank0, rank1 = (ActionEngine(cfg, "job", rank, 2) for rank in (0, 1))
    rank0.start()
    rank1.start()
    job = root / "job"
    (job / CONTROL_FILE).write_bytes(control)
    (job / SCHEDULE_FILE).write_bytes(schedule)
    bounded(lambda: rank0.step_end(1, 1.0, True), CASE_SECONDS)
    bounded(lambda: rank1.step_end(1, 1.0, True), CASE_SECONDS)
    try:
        valid = Request.from_json(json.loads(control.decode("utf-8")))
    except (ValueError, UnicodeDecodeError, RecursionError):
        valid = None
    if valid:   # rank 0 accepted it: schedule.json now lists it
        scheduled = json.loads((job / SCHEDULE_FILE).read_text())["actions"]
        assert [r["id"] for r in scheduled] == [valid.id] and rank0.errors == 0
    else:
        assert rank0.errors == 1
    write_json_atomic(job / SCHEDULE_FILE, {"actions": []})   # rank 1 reads a good one again
    bounded(lambda: rank1.step_end(2, 1.0, True), CASE_SECONDS)
