"""Property: any YAML document or value either loads or raises ConfigError naming a key."""
from __future__ import annotations

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mfotel.config import KNOWN_KEYS, ConfigError, load_config, parse_config

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
keys = st.one_of(st.sampled_from([*KNOWN_KEYS, "console", "file", "file_path", "format", "host",
                                  "port", "endpoint", "headers", "los", "step_intervall"]),
                 st.text(max_size=8))
values = st.recursive(scalars, lambda children: st.one_of(
    st.lists(children, max_size=4), st.dictionaries(keys, children, max_size=4)), max_leaves=12)


def _check(call) -> None:
    try:
        call()
    except ConfigError as exc:
        assert exc.key and exc.fix and "Fix:" in str(exc)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(keys, values, max_size=6))
def test_random_blocks_load_or_raise_config_error(block):
    _check(lambda: parse_config(block, source="fuzz.yaml"))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values)
def test_random_documents_load_or_raise_config_error(tmp_path, document):
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({"monitor_config": document} if isinstance(document, dict)
                                   and len(document) % 2 else document))
    _check(lambda: load_config(path))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=200))
def test_random_bytes_load_or_raise_config_error(tmp_path, data):
    path = tmp_path / "train.yaml"
    path.write_bytes(data)
    _check(lambda: load_config(path))
