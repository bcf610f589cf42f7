"""Token buckets at any accepted rate: a 429 with a whole, bounded Retry-After, never a 500."""
from __future__ import annotations

import math

import bcrypt
import pytest

from mfotel.endpoint.auth import BasicAuth
from mfotel.endpoint.ratelimit import MAX_RETRY_AFTER, TokenBucket, retry_after
from mfotel.endpoint.server import Server
from tests.support.endpoint import basic, request, serve

PASSWORD = "rate-pw"


def ok(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok\n"]


@pytest.fixture
def tiny_failure_rate():
    """A real server behind basic auth with auth_failures_per_second: 5e-324, the smallest
    positive float (it once made every request past the burst a 500: OverflowError)."""
    users = {"prometheus": bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4))}
    server = Server(BasicAuth(ok, users, failures_per_second=5e-324), "127.0.0.1", 0).start()
    yield server.port
    server.close()


def test_a_tiny_failure_rate_answers_429_with_a_bounded_retry_after(tiny_failure_rate):
    port = tiny_failure_rate
    wrong = [request(port, **basic("prometheus", f"guess-{i}")) for i in range(6)]
    assert [r.status for r in wrong] == [401] * 5 + [429]
    assert wrong[-1].headers["Retry-After"] == str(MAX_RETRY_AFTER)
    # the first correct login after the burst: bcrypt is not run (no failure token left),
    # so it is refused as rate-limited, with the same bounded wait; never a 500
    first = request(port, **basic("prometheus", PASSWORD))
    assert first.status == 429 and first.headers["Retry-After"] == str(MAX_RETRY_AFTER)


def test_a_web_config_rate_limit_of_one_request_an_eon_answers_429_not_500(port, tmp_path):
    path = tmp_path / "web.yml"
    path.write_text("rate_limit: {interval: 99999999999999999999999999999999999999h, burst: 1}\n")
    telemetry, _ = serve(port, web_config_file=str(path))
    try:
        replies = [request(port) for _ in range(3)]
    finally:
        telemetry.shutdown()
    assert [r.status for r in replies] == [200, 429, 429]
    assert {r.headers["Retry-After"] for r in replies[1:]} == {str(MAX_RETRY_AFTER)}


@pytest.mark.parametrize("seconds,header", [
    (0.0, "1"), (0.2, "1"), (1.0, "1"), (1.5, "2"), (3599.5, str(MAX_RETRY_AFTER)),
    (1e9, str(MAX_RETRY_AFTER)), (math.inf, str(MAX_RETRY_AFTER)),
    (math.nan, str(MAX_RETRY_AFTER))])
def test_retry_after_is_whole_seconds_between_1_and_the_cap(seconds, header):
    assert retry_after(seconds) == header


@pytest.mark.parametrize("rate", [5e-324, 1e-300, 1e-9, 1.0, 1e9, 1e308, math.inf])
def test_a_bucket_at_any_positive_rate_never_raises(rate):
    now = [0.0]
    bucket = TokenBucket(rate, 2, clock=lambda: now[0])
    assert bucket.take() and bucket.take() and not bucket.take()
    wait = bucket.seconds_to_token()
    assert wait >= 0 and not math.isnan(wait)
    now[0] = 1e6  # a long while later
    assert bucket.level() <= 2
    assert bucket.take() == (rate * 1e6 >= 1)
    bucket.spend()
    assert not math.isnan(bucket.level()) and bucket.level() >= -2
    assert int(retry_after(bucket.seconds_to_token())) <= MAX_RETRY_AFTER
