"""Property: any document or value either loads or raises ConfigError naming the file and a key.

Generated documents use our keys with wrong types, unicode digits, huge numbers, long text,
deep nesting and aliases (up to billion-laughs expansion). The Hypothesis deadline is a hang
detector (seconds per case), not a speed measurement.
"""
from __future__ import annotations

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mfotel.config import KNOWN_KEYS, ConfigError, load_config, parse_config
from mfotel.config.source import MAX_BYTES, MAX_NODES, parse_yaml
from tests.support.paths import ROOT
from tests.support.waiting import settle
from tests.support.yaml_cost import CostMeter

#: ms per case: a hang detector, far above any real case (seconds), scaled with the load
HANG = int(settle(10) * 1000)
#: tmp_path is shared by a test's examples, harmlessly: each example rewrites the file it reads
TMP_PATH_OK = [HealthCheck.function_scoped_fixture]
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


@settings(max_examples=200, deadline=HANG, suppress_health_check=TMP_PATH_OK)
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


@settings(max_examples=150, deadline=HANG, suppress_health_check=TMP_PATH_OK)
@given(st.one_of(aliased_documents(), nested_documents()))
def test_aliases_and_nesting_load_or_raise_config_error(tmp_path, text):
    path = tmp_path / "train.yaml"
    path.write_text(text)
    _load_or_config_error(path)


@settings(max_examples=200, deadline=HANG, suppress_health_check=TMP_PATH_OK)
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


# ---------------------------------------------------------------- what a refusal costs
#: Any document, refused or not, costs at most this much to load (issue 24: a flat 4 MiB
#: list took 16.6 s and ~1 GB before it was refused).
MAX_CPU_SECONDS, MAX_PEAK_BYTES = 0.5, 64 * 2**20
ITEMS = ["0", "x", "lossy", "1.5e3", "null", "{a: 1}", "[1, 2]", "*a", "'q'"]


@pytest.fixture(scope="module")
def meter():
    with CostMeter() as worker:
        yield worker


def _flow(items: list[str]) -> str:
    return "[" + ", ".join(items) + "]"


@st.composite
def big_documents(draw) -> str:
    """Large documents of every shape, around both limits (bytes and values)."""
    shape = draw(st.sampled_from(["list", "block list", "keys", "aliases", "nested", "scalar"]))
    count = draw(st.one_of(st.integers(0, 700_000),
                           st.integers(MAX_NODES - 50, MAX_NODES + 50).map(lambda n: n // 2)))
    item = draw(st.sampled_from(ITEMS))
    where = draw(st.sampled_from(["x", "monitor_config: {metrics", "monitor_config: {run",
                                  "monitor_config: {file_sd: {labels"]))
    head = "a: &a [1, 2]\n"
    if shape == "list":
        body = _flow([item] * count)
    elif shape == "block list":
        return head + "monitor_config: {step_interval: 5}\nx:\n" + f"  - {item}\n" * count
    elif shape == "keys":
        body = "{" + ", ".join(f"k{i}: {item}" for i in range(min(count, 200_000))) + "}"
    elif shape == "aliases":
        body = _flow(["*a"] * count)
    elif shape == "nested":
        body = "[" * min(count, 20_000) + "]" * min(count, 20_000)
    else:
        body = '"' + "x" * min(count * 3, 2 * 2**20) + '"'
    closing = "}" * where.count("{")
    prefix = "monitor_config: {step_interval: 5}\n" if where == "x" else ""
    return f"{head}{prefix}{where}: {body}{closing}\n"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(big_documents())
def test_any_document_costs_at_most_half_a_second_and_64_mib(meter, tmp_path_factory, text):
    path = tmp_path_factory.mktemp("cost") / "train.yaml"
    path.write_text(text)
    cost = meter.load(path)
    assert cost.cpu_seconds < MAX_CPU_SECONDS, (cost, len(text))
    assert cost.peak_bytes < MAX_PEAK_BYTES, (cost, len(text))


@pytest.mark.parametrize("name, text, words", [
    ("a flat 4 MiB list", "x: [" + ",".join(["0"] * (2 * 2**20 - 4)) + "]\n",
     f"larger than {MAX_BYTES // 2**20} MiB"),
    ("210k aliases", "a: &a [1]\nmonitor_config: {step_interval: 5}\nx: ["
     + ",".join(["*a"] * 210_000) + "]\n", f"expands to more than {MAX_NODES} values"),
    ("150k keys", "monitor_config: {step_interval: 5}\nx:\n"
     + "".join(f"  k{i}: 0\n" for i in range(150_000)), "larger than 1 MiB"),
    ("100k keys in 1 MiB", "monitor_config: {step_interval: 5}\nx: {"
     + ",".join(f"{i}: 0" for i in range(100_000)) + "}\n", f"more than {MAX_NODES} values"),
])
def test_the_issues_documents_are_refused_cheaply(meter, tmp_path, name, text, words):
    path = tmp_path / "train.yaml"
    path.write_text(text)
    cost = meter.load(path)
    assert cost.refused and words in cost.message, (name, cost)
    assert cost.cpu_seconds < MAX_CPU_SECONDS and cost.peak_bytes < MAX_PEAK_BYTES, (name, cost)


def test_a_mindformers_yaml_of_a_few_hundred_kb_still_loads(meter, tmp_path):
    """The shipped example plus 300 KB of commented settings (mindformers' own configs are
    ~20 KB): accepted, within the same bounds."""
    example = (ROOT / "examples/mindformers/tiny_llama_cpu.yaml").read_text()
    extra = "".join(f"  setting_{i}: {i * 0.5}   # {'what this setting does; ' * 3}\n"
                    for i in range(3500))
    path = tmp_path / "big_llama.yaml"
    path.write_text(example + "extra_settings:\n" + extra)
    assert len(path.read_bytes()) > 300 * 1024
    cost = meter.load(path)
    assert not cost.refused, cost
    assert cost.cpu_seconds < MAX_CPU_SECONDS and cost.peak_bytes < MAX_PEAK_BYTES, cost
