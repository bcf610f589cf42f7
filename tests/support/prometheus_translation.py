"""OTLP metric name -> Prometheus metric name, as an OpenTelemetry Collector or Prometheus names it.

The OpenTelemetry Collector's `prometheus` and `prometheusremotewrite` exporters and
Prometheus' own OTLP receiver translate names with the Go library prometheus/otlptranslator,
following the OpenTelemetry specification "Prometheus and OpenMetrics Compatibility" (OTLP
metric points to Prometheus). No Python implementation of these rules exists
(opentelemetry-exporter-prometheus maps units but differs: it never adds `_ratio`), so this is
a port of the documented rules for the escaping strategies, table-tested in
tests/unit/test_contract_golden.py:

- `UnderscoreEscapingWithSuffixes` (the default): the name is split into tokens at every
  character outside `[a-zA-Z0-9:]`; the unit adds a suffix (`s` -> `seconds`, `By/s` ->
  `bytes_per_second`; annotations in braces add nothing; `1` adds nothing) unless the name
  already has that token; monotonic sums get `_total`; gauges of unit `1` get `_ratio`; a
  leading digit gets a `_` prefix.
- `UnderscoreEscapingWithoutSuffixes`: invalid characters become `_`, nothing is appended.
"""
from __future__ import annotations

import re
from typing import Literal

Kind = Literal["gauge", "counter", "updowncounter", "histogram", "summary"]

#: UCUM units -> Prometheus unit words (main unit).
UNITS = {
    "d": "days", "h": "hours", "min": "minutes", "s": "seconds", "ms": "milliseconds",
    "us": "microseconds", "ns": "nanoseconds",
    "By": "bytes", "KiBy": "kibibytes", "MiBy": "mebibytes", "GiBy": "gibibytes",
    "TiBy": "tibibytes", "KBy": "kilobytes", "MBy": "megabytes", "GBy": "gigabytes",
    "TBy": "terabytes",
    "m": "meters", "V": "volts", "A": "amperes", "J": "joules", "W": "watts", "g": "grams",
    "Cel": "celsius", "Hz": "hertz", "1": "", "%": "percent",
}
#: UCUM units -> the word after `per_` (the unit after a `/`).
PER_UNITS = {"s": "second", "m": "minute", "h": "hour", "d": "day", "w": "week",
             "mo": "month", "y": "year"}

_INVALID = re.compile(r"[^a-zA-Z0-9:]")
_INVALID_BUT_UNDERSCORE = re.compile(r"[^a-zA-Z0-9:_]+")


def _clean_unit(word: str) -> str:
    """Invalid characters -> `_`, runs of `_` collapsed, no leading `_`."""
    return re.sub(r"_+", "_", _INVALID.sub("_", word)).removeprefix("_")


def _unit_words(unit: str) -> tuple[str, str]:
    """(main suffix, `per_` suffix) of a UCUM unit string, before cleaning."""
    main, slash, per = unit.partition("/")
    main = main.strip()
    main_word = UNITS.get(main, main) if main and not set(main) & set("{}") else ""
    per_word = ""
    if slash and per.strip() and not set(per.strip()) & set("{}"):
        per_word = "per_" + PER_UNITS.get(per.strip(), per.strip())
    return main_word, per_word


def prometheus_name(name: str, unit: str, kind: Kind, suffixes: bool = True) -> str:
    """The Prometheus name of an OTLP metric (`kind` "counter" = a monotonic sum)."""
    if not suffixes:
        joined = "_".join(t for t in _INVALID_BUT_UNDERSCORE.split(name) if t)
        return "_" + joined if joined[:1].isdigit() else joined
    tokens = [t for t in _INVALID.split(name) if t]
    main_word, per_word = (_clean_unit(w) for w in _unit_words(unit))
    if main_word in tokens:
        main_word = ""
    if per_word == "per_":
        per_word = ""
    else:
        per_word = per_word.removesuffix("_")
        if per_word in tokens:
            per_word = ""
    if per_word:
        main_word = main_word.removesuffix("_")
    tokens += [w for w in (main_word, per_word) if w]
    if kind == "counter":
        tokens = [t for t in tokens if t != "total"] + ["total"]
    if unit == "1" and kind == "gauge":
        tokens = [t for t in tokens if t != "ratio"] + ["ratio"]
    joined = "_".join(tokens)
    return "_" + joined if joined[:1].isdigit() else joined
