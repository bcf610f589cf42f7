"""Secrets never printed: header values, URL passwords and token-like values become ***.

Nor sent: values of secret-named resource attributes reach target_info and OTLP as ***
(mfotel.telemetry.build_resource), those of file_sd labels the target files as ***
(mfotel.cluster.discovery.dump_targets).

    redact_url("http://u:pw@collector:4318/v1/metrics?token=t")
    # http://u:***@collector:4318/v1/metrics?token=***
    redact_headers({"authorization": "Bearer x"})     # {"authorization": "***"}
    redact_named({"db.password": "pw", "team": "a"})  # {"db.password": "***", "team": "a"}
    redact_text(str(exc))                             # URL passwords inside any text
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "***"
V = TypeVar("V")
#: Names of query parameters, labels and attributes that carry credentials (api_key=,
#: token=, db.password, ...): their values are never shown.
_SECRET_NAME = re.compile(r"(?i)(token|key|secret|passw|pwd|auth|sig|credential|cookie|session)")
_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)[^/\s@]*@")


def redact_url(url: str) -> str:
    """`url` with its password and credential-like query values replaced by ***."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return redact_text(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:{MASK}@{hostport}" if ":" in userinfo else f"{MASK}@{hostport}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, MASK if is_secret_name(k) else v) for k, v in pairs],
                          safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """Header names kept, every value masked (vendors put API keys in headers of any name)."""
    return {name: MASK for name in headers}


def is_secret_name(name: str) -> bool:
    """Whether a key, label or attribute named `name` holds a credential, by its name."""
    return bool(_SECRET_NAME.search(name))


def redact_named(values: Mapping[str, V]) -> dict[str, V | str]:
    """`values` with the values of credential-like names (password, token, ...) masked.

    Also what leaves the process: resource attributes (target_info, OTLP) and file_sd labels.
    """
    return {name: MASK if is_secret_name(name) else value for name, value in values.items()}


def redact_text(text: str) -> str:
    """`text` (an exception message, a log line) with any URL password masked."""
    return _USERINFO.sub(lambda m: f"{m['head']}{MASK}@", text)
