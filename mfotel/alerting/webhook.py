"""Alertmanager webhook payloads (version 4), parsed strictly from untrusted bytes.

    alerts = decode_notification(body)      # PayloadError (a ValueError) says what is wrong
    print(alerts[0].line())                 # one line, control characters escaped

Every error names the field (`alerts[2].labels.rank: a string, not list`), so a 400 tells the
sender what to fix. Limits: `MAX_DEPTH` levels of JSON nesting (a notification has 4), label
names as Prometheus allows them, label values without control characters or line breaks.
Annotations may span lines (templated descriptions do); they are escaped when printed.
"""
from __future__ import annotations

import json
import re
import time
import unicodedata
from dataclasses import dataclass, field
from typing import Any

#: A notification nests 4 levels (body > alerts > alert > labels); leave room for new fields.
MAX_DEPTH = 16
#: Printed fields are cut here, so one forged field cannot make a megabyte line.
MAX_PRINTED_CHARS = 1000
STATUSES = ("firing", "resolved")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_TEXT_FIELDS = ("startsAt", "endsAt", "fingerprint", "generatorURL")


class PayloadError(ValueError):
    """The body is not an Alertmanager webhook notification; the message says why."""


@dataclass(frozen=True)
class ReceivedAlert:
    """One alert of one Alertmanager notification, as received."""

    status: str                      # "firing" or "resolved"
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: str = ""
    ends_at: str = ""
    receiver: str = ""
    group_key: str = ""
    fingerprint: str = ""
    received_at: float = field(default_factory=time.time)   # unix seconds

    @property
    def alertname(self) -> str:
        return self.labels.get("alertname", "")

    @property
    def firing(self) -> bool:
        return self.status == "firing"

    def line(self) -> str:
        """`[FIRING critical] Name job_name=x rank=0: summary` / `[RESOLVED] Name ...`.

        Always one line: control characters and line breaks are printed escaped (`\\n`).
        """
        severity = self.labels.get("severity")
        head = (f"[FIRING {printable(severity)}]" if severity else "[FIRING]") if self.firing \
            else f"[{printable(self.status.upper())}]"
        where = " ".join(f"{key}={printable(self.labels[key])}" for key in ("job_name", "rank")
                         if key in self.labels)
        text = self.annotations.get("summary") or self.annotations.get("description", "")
        return f"{head} {printable(self.alertname)}{' ' + where if where else ''}: " \
               f"{printable(text)}"

    def size(self) -> int:
        """Approximate characters held (bounds what a receiver keeps in memory)."""
        return sum(len(k) + len(v) for part in (self.labels, self.annotations)
                   for k, v in part.items()) + len(self.starts_at) + len(self.group_key) + 200


def printable(text: str, limit: int = MAX_PRINTED_CHARS) -> str:
    """`text` on one line: non-printable characters escaped (`\\n`, `\\x1b`, `\\u2028`), cut
    at `limit` characters with a note of how many were dropped."""
    if text.isprintable() and len(text) <= limit:
        return text
    out = "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
                  for ch in text[:limit])
    return out + (f"... ({len(text) - limit} more characters)" if len(text) > limit else "")


def _breaks_lines(value: str) -> bool:
    """Control characters (C0, C1) and Unicode line/paragraph separators."""
    return any(unicodedata.category(ch) in ("Cc", "Zl", "Zp") for ch in value
               if not ch.isprintable())


def _depth(data: Any) -> int:
    """Nesting depth of parsed JSON, without recursion."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        item, level = stack.pop()
        deepest = max(deepest, level)
        if isinstance(item, dict):
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, level + 1) for v in item)
    return deepest


def _kind(value: Any) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def _strings(where: str, value: Any, labels: bool) -> dict[str, str]:
    if not isinstance(value, dict):
        raise PayloadError(f"{where}: an object of strings, not {_kind(value)}")
    for key, item in value.items():
        if labels and not _LABEL_NAME.fullmatch(key):
            raise PayloadError(f"{where}: \"{printable(key, 60)}\" is not a label name "
                               f"([a-zA-Z_][a-zA-Z0-9_]*)")
        if not isinstance(item, str):
            raise PayloadError(f"{where}.{printable(key, 60)}: a string, not {_kind(item)}")
        if labels and _breaks_lines(item):
            raise PayloadError(f"{where}.{key}: control characters or line breaks in a label "
                               f"value (\"{printable(item, 60)}\")")
    return value


def _object(raw: dict[str, Any], key: str) -> Any:
    value = raw.get(key)
    return {} if value is None else value


def _text(where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise PayloadError(f"{where}: a string, not {_kind(value)}")
    return value


def parse_notification(payload: Any, received_at: float | None = None) -> list[ReceivedAlert]:
    """The alerts of a parsed webhook payload; PayloadError naming the bad field."""
    if not isinstance(payload, dict):
        raise PayloadError(f"not an Alertmanager webhook payload: a JSON {_kind(payload)}, "
                           f"not an object")
    if not isinstance(payload.get("alerts"), list):
        raise PayloadError("not an Alertmanager webhook payload: no 'alerts' list")
    if _depth(payload) > MAX_DEPTH:
        raise PayloadError(f"JSON nested deeper than {MAX_DEPTH} levels")
    receiver, group_key, default_status = (
        _text(key, payload.get(key, "")) for key in ("receiver", "groupKey", "status"))
    now = time.time() if received_at is None else received_at
    alerts = []
    for index, raw in enumerate(payload["alerts"]):
        where = f"alerts[{index}]"
        if not isinstance(raw, dict):
            raise PayloadError(f"{where}: an object, not {_kind(raw)}")
        status = raw.get("status")
        if status is None:
            status = default_status or "firing"
        status = _text(f"{where}.status", status)
        if status not in STATUSES:
            raise PayloadError(f"{where}.status: \"{printable(status, 60)}\" is not firing "
                               f"or resolved")
        texts = {key: _text(f"{where}.{key}", raw.get(key, "")) for key in _TEXT_FIELDS}
        alerts.append(ReceivedAlert(
            status=status,
            labels=_strings(f"{where}.labels", _object(raw, "labels"), labels=True),
            annotations=_strings(f"{where}.annotations", _object(raw, "annotations"),
                                 labels=False),
            starts_at=texts["startsAt"], ends_at=texts["endsAt"], receiver=receiver,
            group_key=group_key, fingerprint=texts["fingerprint"], received_at=now))
    return alerts


def decode_notification(body: bytes, received_at: float | None = None) -> list[ReceivedAlert]:
    """The alerts of a raw webhook body; PayloadError (never another exception) if malformed."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PayloadError(f"the body is not UTF-8 (byte {exc.start})") from None
    try:
        payload = json.loads(text)
    except RecursionError:
        raise PayloadError(f"JSON nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, and integers longer than Python converts
        raise PayloadError(f"the body is not JSON ({printable(str(exc), 200)})") from None
    return parse_notification(payload, received_at)
