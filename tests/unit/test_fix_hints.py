"""A bad value's fix fits its key: what it tells the user to write is a value the key takes.

One row per kind of key (whole number, number, boolean, rank list, list, enum), and, for every
numeric key of the schema, the property that the fix of a quoted number names a YAML value
which reads back as that number and passes the key's check.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from mfotel.config import ConfigError, parse_config
from mfotel.config.fields import Field, Int, ListOf, Number, Optional, Section
from mfotel.config.keys import MONITOR


def fix_of(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as error:
        parse_config(data, source="train.yaml")
    [problem] = error.value.errors
    return str(problem).split(". Fix: ", 1)[1]


@pytest.mark.parametrize("data, fix", [
    # whole numbers: the number unquoted, never 50.0
    ({"step_interval": "50"}, "(YAML read '50' as text: write step_interval: 50 unquoted)"),
    ({"step_interval": "1e3"}, "(YAML read '1e3' as text: write step_interval: 1000 unquoted)"),
    ({"prometheus": {"port": "9464"}}, "write port: 9464 unquoted"),
    ({"native_series_limit": "2e4"}, "write native_series_limit: 20000 unquoted"),
    # numbers (seconds, factors, FLOPs): a float YAML reads back as a number
    ({"otlp": {"interval_seconds": "2.5"}}, "write interval_seconds: 2.5 unquoted"),
    ({"otlp": {"interval_seconds": "50"}}, "write interval_seconds: 50.0 unquoted"),
    ({"peak_flops": "3.13e14"}, "write peak_flops: 313000000000000.0 unquoted"),
    ({"peak_flops": "1e20"}, "write peak_flops: 1.0e+20 unquoted"),
    ({"actions": {"nonfinite": {"action": "scale_lr", "factor": "1e-3"}}},
     "write factor: 0.001 unquoted"),
    # booleans
    ({"output": {"console": "true"}}, "write console: true unquoted (YAML read 'true' as text)"),
    ({"output": {"console": "False"}}, "write console: false unquoted"),
    ({"output": {"console": "yes please"}}, "write console: true or false (unquoted)"),
    # ranks
    ({"log_rank": "0"}, "(YAML read '0' as text: write log_rank: 0 unquoted)"),
    ({"log_rank": "-1"}, "write log_rank: -1 unquoted"),
    # lists and enums: the known values, the closest one
    ({"metrics": ["loss", "los"]}, "use one of: loss, learning_rate, grad_norm, throughput, "
                                   "step_time (did you mean 'loss'?)"),
    ({"on_nonfinite": "Stop"}, "use one of: warn, stop (did you mean 'stop'?)"),
    ({"output": {"format": "JSON"}}, "use one of: text, json (did you mean 'json'?)"),
])
def test_the_fix_names_a_value_of_the_keys_kind(data, fix):
    assert fix in fix_of(data)


@pytest.mark.parametrize("data", [
    {"step_interval": "50.5"},   # not a whole number: no number to suggest
    {"step_interval": "0"},      # out of bounds: the fix above says what to use
    {"otlp": {"interval_seconds": "0.01"}},
    {"log_rank": "1.5"},
])
def test_no_unquoted_hint_for_a_number_the_key_refuses(data):
    assert "unquoted" not in fix_of(data)


def numeric_keys(section: Section = MONITOR, at: str = "") -> Iterator[tuple[str, Field]]:
    """(dotted key, field) of every whole-number and number key, through sections and
    optional values."""
    for name, item in section.keys.items():
        inner = item.inner if isinstance(item, Optional) else item
        if isinstance(inner, Section):
            yield from numeric_keys(inner, f"{at}{name}.")
        elif isinstance(inner, (Int, Number)):
            yield f"{at}{name}", inner


def nest(key: str, value: Any) -> dict[str, Any]:
    data: Any = value
    for part in reversed(key.split(".")):
        data = {part: data}
    return data


def test_numeric_keys_cover_every_kind():
    kinds = {type(f) for _, f in numeric_keys()}
    assert kinds == {Int, Number} and len(list(numeric_keys())) >= 15


@pytest.mark.parametrize("key, field", list(numeric_keys()), ids=[k for k, _ in numeric_keys()])
def test_a_quoted_number_gets_a_fix_yaml_reads_back_as_a_valid_value(key, field):
    example = field.example
    data = nest(key, str(example))
    if key.startswith("actions.") and key.split(".")[1] in ("nonfinite", "plateau"):
        data["actions"][key.split(".")[1]]["action"] = "scale_lr"  # factor needs scale_lr
    fix = fix_of(data)
    leaf = key.rsplit(".", 1)[-1]
    written = re.search(rf"write {leaf}: (\S+) unquoted", fix)
    assert written, fix
    back = yaml.safe_load(f"{leaf}: {written[1]}")[leaf]
    assert back == example and not isinstance(back, str)
    if isinstance(field, Int):
        assert isinstance(back, int) and "." not in written[1]
    assert field.check(back, "train.yaml", key) == example
    shown_example = re.search(rf"e\.g\. {leaf}: (\S+)", fix)
    assert shown_example, fix
    assert not isinstance(yaml.safe_load(f"v: {shown_example[1]}")["v"], str), fix


def test_list_keys_are_lists_of_their_item():
    assert any(isinstance(f, ListOf) for f in MONITOR.keys.values())
