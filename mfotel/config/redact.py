"""Secrets never printed: header values, URL passwords and token-like query values become ***.

    redact_url("http://u:pw@collector:4318/v1/metrics?token=t")  # http://u:***@collector:4318/v1/metrics?token=***
    redact_headers({"authorization": "Bearer x"})               # {"authorization": "***"}
    redact_text(str(exc))                                       # URL passwords inside any text
"""
from __future__ import annotations

import re
from typing import Mapping
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "***"
#: Query parameters that carry credentials (api_key=, token=, ...).
_SECRET_QUERY = re.compile(r"(?i)(token|key|secret|passw|auth|sig|credential)")
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
        query = urlencode([(k, MASK if _SECRET_QUERY.search(k) else v) for k, v in pairs],
                          safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """Header names kept, every value masked (vendors put API keys in headers of any name)."""
    return {name: MASK for name in headers}


def redact_text(text: str) -> str:
    """`text` (an exception message, a log line) with any URL password masked."""
    return _USERINFO.sub(lambda m: f"{m['head']}{MASK}@", text)
