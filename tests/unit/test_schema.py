"""`mfotel schema`: the JSON Schema (draft 2020-12) of monitor_config, checked with `jsonschema`.

The schema is generated from the same key table as the validator; these tests check that the
two agree (a table of good and bad documents, and generated ones), and that every shipped
example and documented block is valid under both.
"""
from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from mfotel.config import ConfigError, json_schema, parse_config
from mfotel.config.settings import NATIVE_MONITOR_KEYS
from tests.support.paths import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def validator(kind: str) -> jsonschema.Draft202012Validator:
    schema = json_schema(kind)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@functools.cache
def block_schema() -> jsonschema.Draft202012Validator:
    """The block schema's validator, made once a process when a test first asks."""
    return validator("block")


def hand_ok(block: Any) -> bool:
    try:
        parse_config(block)
        return True
    except ConfigError:
        return False


@pytest.mark.parametrize("kind", ["plain", "mindformers", "block"])
def test_schema_is_a_valid_draft_2020_12_schema(kind):
    schema = json_schema(kind)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)


def test_every_key_has_a_description_for_editors():
    properties = json_schema("block")["properties"]
    assert set(properties) >= {"enable", "step_interval", "metrics", "output", "otlp", "job_name"}
    missing = [k for k, v in properties.items() if not v.get("description")]
    assert not missing
    assert properties["step_interval"]["default"] == 1
    assert properties["metrics"]["default"] == ["loss", "learning_rate"]


GOOD = [
    {},
    {"enable": True, "step_interval": 50, "metrics": ["loss", "learning_rate", "grad_norm"]},
    {"monitor_on": False, "interval": 7},
    {"metrics": "loss, learning_rate"},
    {"output": {"console": True, "file": True, "file_path": "./m/{job_name}_{rank}.log",
                "format": "json"}},
    {"output": None},
    {"output": {"file_path": "./m_{{literal}}.log"}},
    {"log_rank": -1}, {"log_rank": [0, 8]}, {"log_rank": "all"}, {"log_rank": 3},
    {"job_name": "llama7b-sft.v2"}, {"job_name": None},
    {"prometheus": {"host": "127.0.0.1", "port": 0, "linger_seconds": 86400,
                    "linger_until_scraped": False}},
    {"prometheus": {"certfile": "c.pem", "keyfile": "k.pem"}},
    {"on_nonfinite": "stop"},
    {"resource_attributes": {"team": "nlp", "replicas": 4}},
    {"otlp": {"endpoint": "http://collector:4318", "interval_seconds": 1.5,
              "timeout_seconds": 3600, "headers": {"authorization": "Bearer x"}}},
    {"otlp": {"endpoint": "https://user:pw@collector.example:443/otlp/v1/metrics"}},
    {"early_steps": 100, "early_step_interval": 2, "batch_size": 8, "seq_length": 2048,
     "native_series_limit": 1000000},
    {"alertmanager_url": "http://alertmanager:9093"},
    {"actions": {"plateau": {"patience": 3, "action": "scale_lr", "factor": 0.1, "min_delta": 0.01},
                 "nonfinite": {}, "control_dir": "/ctl/{job_name}", "lead_steps": 2}},
    {"actions": {"nonfinite": {"action": "warn"}}, "on_nonfinite": "warn"},
    {"file_sd": {"path": "/sd/{job_name}-{rank}.json", "mode": "rank", "labels": {"c": "a"}}},
    {"file_sd": {"path": "/sd/{job_name}.json", "hosts": ["n1", "n2"]}},
    {"file_sd": {"hosts": "n1, n2"}},
    {"cardinality": "health", "metric_ranks": [0, 8]}, {"metric_ranks": 0},
    {"run": {"id": "run-1", "state_file": "./s_{rank}.json"}},
]
BAD = [
    [], "loss", {"step_intervall": 5}, {"step_interval": 0}, {"step_interval": "5"},
    {"step_interval": 2.5}, {"step_interval": True}, {"step_interval": 2**40},
    {"enable": "yes"}, {"enable": True, "monitor_on": True},
    {"metrics": []}, {"metrics": ["lr"]}, {"metrics": "loss, lr"}, {"metrics": [1]},
    {"output": "console"}, {"output": {"consol": True}}, {"output": {"format": "csv"}},
    {"output": {"file_path": "./m_{foo}.log"}}, {"output": {"file_path": "./m_{rank:>9}.log"}},
    {"output": {"file_path": "./m_{0}.log"}}, {"output": {"file_path": "./m_}.log"}},
    {"output": {"file_path": ""}},
    {"log_rank": -2}, {"log_rank": []}, {"log_rank": "first"}, {"log_rank": [0, "1"]},
    {"job_name": "../../esc"}, {"job_name": "a b"}, {"job_name": "x" * 129}, {"job_name": ""},
    {"prometheus": {"port": 70000}}, {"prometheus": {"port": -1}},
    {"prometheus": {"linger_seconds": 86401}}, {"prometheus": {"linger_seconds": -1}},
    {"prometheus": {"certfile": "c.pem"}}, {"prometheus": {"keyfile": "k.pem"}},
    {"prometheus": {"linger_until_scraped": "no"}},
    {"on_nonfinite": "explode"}, {"on_nonfinite": "Stop"},
    {"resource_attributes": {"service.name": "x"}}, {"resource_attributes": {"a": [1]}},
    {"resource_attributes": {"a": None}}, {"resource_attributes": "team=nlp"},
    {"otlp": {"endpoint": "collector:4318"}}, {"otlp": {"endpoint": "ftp://c:21"}},
    {"otlp": {"endpoint": "http://c:4318/v1/traces"}}, {"otlp": {"interval_seconds": 0}},
    {"otlp": {"interval_seconds": 1e300}}, {"otlp": {"timeout_seconds": 7200}},
    {"otlp": {"headers": ["a"]}},
    {"alertmanager_url": "alertmanager:9093"},
    {"batch_size": 0}, {"seq_length": -5}, {"native_series_limit": 0},
    {"native_series_limit": 10**7},
    {"actions": {"plateau": {"factor": 0.5}}}, {"actions": {"plateau": {"patience": 0}}},
    {"actions": {"nonfinite": {"action": "halt"}}}, {"actions": {"control_dir": "/c/{rank}"}},
    {"actions": {"lead_steps": 0}}, {"actions": {"stop_on": "nan"}},
    {"actions": {"nonfinite": {}}, "on_nonfinite": "stop"},
    {"file_sd": {"path": "x.json", "mode": "rank"}},
    {"file_sd": {"mode": "rank", "hosts": ["a"]}},
    {"file_sd": {"labels": {"instance": "x"}}}, {"file_sd": {"mode": "node"}},
    {"cardinality": "low"}, {"metric_ranks": [-1]}, {"metric_ranks": []},
    {"run": {"state_file": "/s/{pid}.json"}}, {"run": {"idd": "x"}},
]


@pytest.mark.parametrize("block", GOOD, ids=lambda b: json.dumps(b)[:60])
def test_good_blocks_pass_both(block):
    assert hand_ok(block)
    errors = [e.message for e in block_schema().iter_errors(block)]
    assert not errors, errors


@pytest.mark.parametrize("block", BAD, ids=lambda b: json.dumps(b)[:60])
def test_bad_blocks_fail_both(block):
    assert not hand_ok(block)
    assert list(block_schema().iter_errors(block))


# JSON-compatible blocks (no NaN: JSON cannot hold it; the validator refuses it, tested in
# test_config.py): per key, a pool of good and bad values, so both verdicts are frequent.
_URLS = ["http://c:4318", "https://u:p@c/otlp/v1/metrics", "c:4318", "http://c:4318/v1/logs"]
POOLS: dict[str, list[Any]] = {
    "enable": [True, False, "yes", None], "step_interval": [1, 50, 0, "5", 2.0, 2.5, True],
    "metrics": [["loss"], ["loss", "grad_norm"], "loss, step_time", [], ["lr"], "loss"],
    "log_rank": [0, -1, [0, 8], "all", -2, [], "x", [0, -1]],
    "job_name": ["llama-7b", None, "a b", "", "../x", "x.y_z"],
    "on_nonfinite": ["warn", "stop", "halt"], "early_steps": [0, 10, -1],
    "batch_size": [None, 8, 0], "cardinality": ["full", "health", "low"],
    "metric_ranks": [None, 0, [0, 8], [-1], []], "alertmanager_url": [None, *_URLS],
    "resource_attributes": [{}, {"team": "nlp", "n": 2}, {"service.name": "x"}, {"a": None}],
    "output.console": [True, 1], "output.file": [False, "no"],
    "output.file_path": ["./m_{rank}.log", "{foo}", "./m_{rank:>3}", "m_}", ""],
    "output.format": ["text", "json", "csv"],
    "prometheus.host": ["127.0.0.1", "", 5], "prometheus.port": [0, 9464, 65535, 70000, -1],
    "prometheus.linger_seconds": [0, 30.5, 86400, 86401, -1],
    "prometheus.linger_until_scraped": [True, None],
    "prometheus.certfile": [None, "c.pem"], "prometheus.keyfile": [None, "k.pem"],
    "otlp.endpoint": [None, *_URLS], "otlp.interval_seconds": [10, 1, 0.1, 0, 1e300],
    "otlp.timeout_seconds": [5, 3600, 3601], "otlp.headers": [{}, {"a": "b"}, ["a"]],
    "file_sd.path": [None, "/sd/{job_name}.json", "/sd/{rank}.json", "{host}"],
    "file_sd.mode": ["job", "rank", "node"], "file_sd.hosts": [["n1"], "n1, n2", [], ""],
    "file_sd.labels": [{}, {"c": "a"}, {"instance": "x"}],
    "run.id": [None, "r1", ""], "run.state_file": [None, "./s_{rank}.json", "{pid}"],
}


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    block: dict[str, Any] = {}
    for key, item in flat.items():
        section, _, leaf = key.rpartition(".")
        (block.setdefault(section, {}) if section else block)[leaf] = item
    return block


_GOOD_VALUES = {k: v[:2] for k, v in POOLS.items()}  # the first two of each pool are good
random_blocks = st.fixed_dictionaries(
    {}, optional={k: st.sampled_from(v) for k, v in POOLS.items()})
one_change = st.tuples(
    st.fixed_dictionaries({}, optional={k: st.sampled_from(v) for k, v in _GOOD_VALUES.items()}),
    st.sampled_from(sorted(POOLS)).flatmap(
        lambda k: st.tuples(st.just(k), st.sampled_from(POOLS[k])))
).map(lambda t: {**t[0], t[1][0]: t[1][1]})
blocks = st.one_of(random_blocks, one_change).map(_nest)


@settings(max_examples=600, deadline=None)
@given(blocks)
def test_schema_and_validator_agree_on_generated_blocks(block):
    schema_errors = [e.message for e in block_schema().iter_errors(block)]
    assert hand_ok(block) == (not schema_errors), (block, schema_errors)


# ---------------------------------------------------------------- shipped examples and docs
def yaml_blocks(path: Path) -> list[Any]:
    return [yaml.safe_load(m) for m in re.findall(r"```yaml\n(.*?)```", path.read_text(), re.S)]


def test_the_mindformers_example_is_valid():
    document = yaml.safe_load((ROOT / "examples/mindformers/tiny_llama_cpu.yaml").read_text())
    errors = [e.message for e in validator("mindformers").iter_errors(document)]
    assert not errors
    assert set(document["monitor_config"]) <= set(NATIVE_MONITOR_KEYS)


def test_documented_blocks_are_valid_under_schema_and_validator():
    plain, mindformers = validator("plain"), validator("mindformers")
    checked = 0
    for path in DOCS:
        for document in yaml_blocks(path):
            if isinstance(document, dict) and "monitor_config" in document:
                assert not list(plain.iter_errors(document)), path
                parse_config(document["monitor_config"], source=str(path))
                checked += 1
            elif isinstance(document, dict) and "callbacks" in document:
                assert not list(mindformers.iter_errors(document)), path
                checked += 1
    assert checked >= 5


def test_mindformers_schema_flags_mfotel_keys_in_the_native_block():
    errors = list(validator("mindformers").iter_errors(
        {"monitor_config": {"monitor_on": True, "metrics": ["loss"]},
         "callbacks": [{"type": "OTelMonitor", "step_interval": 0}]}))
    paths = sorted(list(e.absolute_path) for e in errors)
    assert ["monitor_config"] in paths and ["callbacks", 0, "step_interval"] in paths


def test_schema_command_prints_the_schema(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mfotel", "schema"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == json_schema("plain")
    out = tmp_path / "mfotel.schema.json"
    done = subprocess.run([sys.executable, "-m", "mfotel", "schema", "--kind", "mindformers",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and json.loads(out.read_text()) == json_schema("mindformers")
