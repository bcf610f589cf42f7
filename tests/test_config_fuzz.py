"""Property: any document or value either loads or raises ConfigError naming the file and a key.

Generated documents use our keys with wrong types, unicode digits, huge numbers, long text,
deep nesting and aliases (up to billion-laughs expansion). The Hypothesis deadline is a hang
detector (seconds per case), not a speed measurement.
"""
from __future__ import annotations

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mfotel.config import KNOWN_KEYS, ConfigError, load_config, parse_config
from mfotel.config.source import parse_yaml

HANG = 60_000  # ms per case: a hang detector, far above any real case even on a loaded machine
SUB_KEYS = ["console", "file", "file_path", "format", "host", "port", "linger_seconds",
            "endpoint", "headers", "interval_seconds", "timeout_seconds", "path", "mode", "hosts",
            "labels", "plateau", "nonfinite", "control_dir", "factor", "action", "id",
            "state_file", "los", "step_intervall", "type", "callbacks"]
odd_text = st.sampled_from(["²", "٣", "１０", "1e3", "1e10", ".nan", "-.inf", "{rank}", "{foo}",
                            "{rank:>300000000}", "{0}", "../../x", "http://u:p@h:1/v1/logs",
                            "x" * 5000, "all", "-1", "True", "null", "", " "])
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                    st.integers(-10**400, 10**400), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=12), odd_text)
keys = st.one_of(st.sampled_from([*KNOWN_KEYS, *SUB_KEYS]), st.text(max_size=8))
values = st.recursive(scalars, lambda children: st.one_of(
    st.lists(children, max_size=4), st.dictionaries(keys, children, max_size=4)), max_leaves=12)


def _check_error(exc: ConfigError, source: str) -> None:
    assert exc.errors
    for error in exc.errors:
        assert error.source == source and error.key and error.fix, str(error)
        assert str(error).startswith(f"{source}: {error.key}: ") and ". Fix: " in str(error)


def _load_or_config_error(path) -> None:
    try:
        load_config(path)
    except ConfigError as exc:
        _check_error(exc, str(path))


@settings(max_examples=400, deadline=HANG)
@given(st.dictionaries(keys, values, max_size=6))
def test_random_blocks_load_or_raise_config_error(block):
    try:
        parse_config(block, source="fuzz.yaml")
    except ConfigError as exc:
        _check_error(exc, "fuzz.yaml")


@settings(max_examples=200, deadline=HANG, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values)
def test_random_documents_load_or_raise_config_error(tmp_path, document):
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({"monitor_config": document} if isinstance(document, dict)
                                   and len(document) % 2 else document))
    _load_or_config_error(path)


@st.composite
def aliased_documents(draw) -> str:
    """A monitor_config whose values are aliases of a chain of anchors: `a_i` is a list of
    `width` references to `a_{i-1}` (width ** levels values once expanded)."""
    levels, width = draw(st.integers(1, 12)), draw(st.integers(1, 10))
    lines = [f"a0: &a0 {draw(st.sampled_from(['x', '1', '[1, 2]', '{step_interval: 5}']))}"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]"
              for i in range(1, levels + 1)]
    key = draw(st.sampled_from(["job_name", "metrics", "log_rank", "resource_attributes",
                                "output", "run", "file_sd"]))
    return "\n".join(lines) + f"\nmonitor_config: {{{key}: *a{levels}}}\n"


@st.composite
def nested_documents(draw) -> str:
    depth = draw(st.integers(1, 6000))
    opener, closer = draw(st.sampled_from([("[", "]"), ("{a: ", "}")]))
    key = draw(st.sampled_from(["run", "metrics", "output", "unknown"]))
    return f"monitor_config: {{{key}: " + opener * depth + "1" * (opener == "{a: ") + \
        closer * depth + "}\n"


@settings(max_examples=150, deadline=HANG, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(aliased_documents(), nested_documents()))
def test_aliases_and_nesting_load_or_raise_config_error(tmp_path, text):
    path = tmp_path / "train.yaml"
    path.write_text(text)
    _load_or_config_error(path)


@settings(max_examples=200, deadline=HANG, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=200))
def test_random_bytes_load_or_raise_config_error(tmp_path, data):
    path = tmp_path / "train.yaml"
    path.write_bytes(data)
    _load_or_config_error(path)


@settings(max_examples=300, deadline=HANG)
@given(st.text(alphabet=st.sampled_from(list("{}[]:,&*!|>'\"-?#%@` \n\tabc019²")), max_size=80))
def test_yaml_syntax_noise_parses_or_raises_config_error(text):
    try:
        parse_yaml(text, "noise.yaml")
    except ConfigError as exc:
        _check_error(exc, "noise.yaml")
