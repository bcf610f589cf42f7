"""The WSGI helpers every endpoint module shares."""
from __future__ import annotations

from mfotel.endpoint.wsgi import SECURITY_HEADERS, merged_headers, plain


def test_plain_answers_one_line_with_its_length():
    answered: dict[str, object] = {}
    body = plain(lambda status, headers: answered.update(status=status, headers=headers),
                 "429 Too Many Requests", [("Retry-After", "5")])
    assert body == [b"Too Many Requests\n"] and answered["status"] == "429 Too Many Requests"
    assert answered["headers"] == [("Content-Type", "text/plain; charset=utf-8"),
                                   ("Content-Length", "18"), ("Retry-After", "5")]
    assert plain(lambda *_: None, "401 Unauthorized", text="who are you?") == [b"who are you?\n"]


def test_configured_headers_replace_defaults_of_the_same_name_whatever_its_case():
    merged = merged_headers(SECURITY_HEADERS, {"x-frame-options": "sameorigin",
                                               "Strict-Transport-Security": "max-age=60"})
    names = [name.lower() for name, _ in merged]
    assert names.count("x-frame-options") == 1 and ("x-frame-options", "sameorigin") in merged
    assert ("X-Content-Type-Options", "nosniff") in merged
    assert ("Strict-Transport-Security", "max-age=60") in merged
    assert merged_headers(SECURITY_HEADERS, {}) == list(SECURITY_HEADERS)
