"""Kinds of configuration values; each validates a value and describes itself as JSON Schema.

One declaration per key (`keys.py`) yields both the validator (messages naming the key, the
value and the fix) and the schema `mfotel schema` prints, so the two cannot drift apart.

    port = Int(0, 65535, example=9464, doc="base port")
    port.check(70000, "train.yaml", "monitor_config.prometheus.port")   # raises ConfigError
    port.schema()   # {"type": "integer", "minimum": 0, "maximum": 65535, "description": ...}
"""
from __future__ import annotations

import math
import os
import re
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, is_dataclass, replace
from typing import Any
from urllib.parse import urlsplit

from .errors import ConfigError, Problems, did_you_mean, show
from .redact import is_secret_name, redact_url

#: Whole-number settings (steps, sizes, series): below 2**31, far above any real run.
MAX_COUNT = 2**31 - 1
DAY_SECONDS = 86_400.0
_CONTROL = frozenset(map(chr, [*range(32), 127]))  # never in a URL (NUL, line breaks, ...)


def _leaf(key: str) -> str:
    return key.rsplit(".", 1)[-1]


@dataclass(frozen=True, kw_only=True)
class Field:
    """One configuration value: `check` returns it normalised or raises ConfigError.

    `why`: the reason for its bounds, in its description and in the fix of a bad value.
    """
    doc: str = ""
    why: str = ""

    def check(self, value: Any, source: str, key: str) -> Any:
        raise NotImplementedError

    def schema(self) -> dict[str, Any]:
        raise NotImplementedError

    def described(self, default: Any = None) -> dict[str, Any]:
        """The schema with description and default (for editors)."""
        out = self.schema()
        if self.doc:
            out["description"] = f"{self.doc}; {self.why}" if self.why else self.doc
        if default is not None and not is_dataclass(default):
            out["default"] = list(default) if isinstance(default, tuple) else (
                dict(default) if isinstance(default, Mapping) else default)
        return out


@dataclass(frozen=True)
class Bool(Field):
    def check(self, value: Any, source: str, key: str) -> bool:
        if isinstance(value, bool):
            return value
        word = value.strip().lower() if isinstance(value, str) else ""
        fix = (f"write {_leaf(key)}: {word} unquoted (YAML read {value!r} as text)"
               if word in ("true", "false") else f"write {_leaf(key)}: true or false (unquoted)")
        raise ConfigError(source, key, f"{show(value)} is not a boolean", fix)

    def schema(self) -> dict[str, Any]:
        return {"type": "boolean"}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _yaml_number(text: str) -> str:
    """A float's text as YAML 1.1 reads it back as a number: PyYAML takes `1e-05` for text,
    so an exponent needs a dot (`1.0e-05`)."""
    return text.replace("e", ".0e", 1) if "e" in text and "." not in text else text


def _unquoted_hint(field: Field, value: Any, key: str, whole: bool) -> str:
    """YAML 1.1 reads quoted numbers and `1e3` (no dot) as text: when `value` is such a text
    and its number is one `field` takes, the fix names the number to write in the key's kind
    (`whole`: `50`, else `50.0`)."""
    if not (isinstance(value, str) and value.isascii()):
        return ""
    try:
        number = float(value)
    except ValueError:
        return ""
    if not math.isfinite(number) or (whole and not number.is_integer()):
        return ""
    candidate = int(number) if whole else number
    try:
        field.check(candidate, "", key)
    except ConfigError:
        return ""  # the number itself is out of bounds: the fix above says what to use
    written = str(candidate) if whole else _yaml_number(repr(number))
    return f" (YAML read {value!r} as text: write {_leaf(key)}: {written} unquoted)"


def _because(why: str) -> str:
    return f" ({why})" if why else ""


@dataclass(frozen=True)
class Int(Field):
    minimum: int = 0
    maximum: int = MAX_COUNT
    example: int = 1

    def check(self, value: Any, source: str, key: str) -> int:
        number = value
        if isinstance(value, float) and value.is_integer():
            number = int(value)  # JSON Schema's integer: a number without a fraction
        if isinstance(number, int) and not isinstance(number, bool) \
                and self.minimum <= number <= self.maximum:
            return number
        too_big = isinstance(number, int) and number > self.maximum
        bounds = f">= {self.minimum}" if self.maximum == MAX_COUNT and not too_big else \
            f"between {self.minimum} and {self.maximum}"
        raise ConfigError(source, key, f"{show(value)} is not a whole number {bounds}",
                          f"use a whole number {bounds}, e.g. {_leaf(key)}: {self.example}"
                          + _unquoted_hint(self, value, key, whole=True) + _because(self.why))

    def schema(self) -> dict[str, Any]:
        return {"type": "integer", "minimum": self.minimum, "maximum": self.maximum}


@dataclass(frozen=True)
class Number(Field):
    """A finite number in [minimum, maximum] (`positive`: above minimum), e.g. seconds."""
    minimum: float = 0.0
    maximum: float = DAY_SECONDS
    positive: bool = False
    example: float = 1.0
    unit: str = ""

    def check(self, value: Any, source: str, key: str) -> float:
        low_ok = _is_number(value) and (value > self.minimum if self.positive
                                        else value >= self.minimum)
        # compare before float(): an integer of 400 digits is simply above the maximum
        if low_ok and value <= self.maximum and math.isfinite(float(value)):
            return float(value)
        unit = f" of {self.unit}" if self.unit else ""
        sign = "positive " if self.minimum > 0 else ""
        what = (f"a positive number{unit} <= {self.maximum:g}" if self.positive
                else f"a {sign}number{unit} >= {self.minimum:g} and <= {self.maximum:g}")
        raise ConfigError(source, key, f"{show(value)} is not {what}",
                          f"use {what}, e.g. {_leaf(key)}: {_yaml_number(f'{self.example:g}')}"
                          + _unquoted_hint(self, value, key, whole=False) + _because(self.why))

    def schema(self) -> dict[str, Any]:
        low = "exclusiveMinimum" if self.positive else "minimum"
        return {"type": "number", low: self.minimum, "maximum": self.maximum}


@dataclass(frozen=True)
class Text(Field):
    """A non-blank string; `pattern` (a regex valid in Python and JSON Schema) restricts it."""
    pattern: str = ""
    max_length: int = 4096
    what: str = "a non-blank text"
    rule: str = ""      # the pattern in words, for the fix
    example: str = "..."

    def check(self, value: Any, source: str, key: str) -> str:
        if isinstance(value, str) and value.strip() and len(value) <= self.max_length:
            if "\0" in value:
                raise ConfigError(source, key, f"{show(value)} contains a NUL character (\\0)",
                                  f"remove it: no setting can hold one, e.g. {_leaf(key)}: "
                                  f"{self.example}")
            if not self.pattern or re.search(self.pattern, value):
                return value
        rule = self.rule or f"{self.what} of at most {self.max_length} characters"
        raise ConfigError(source, key, f"{show(value)} is not {self.what}",
                          f"use {rule}, e.g. {_leaf(key)}: {self.example}")

    def schema(self) -> dict[str, Any]:
        return {"type": "string", "pattern": self.pattern or r"\S", "maxLength": self.max_length,
                "not": NUL_SCHEMA}


#: Linux limits: a path of at most PATH_MAX - 1 bytes, names of at most NAME_MAX bytes.
PATH_MAX_BYTES, NAME_MAX_BYTES = 4095, 255
NUL_SCHEMA = {"pattern": r"\u0000"}


def path_problem(text: str) -> str | None:
    """Why `text` cannot name a file on this system (NUL is refused by Text), or None."""
    try:
        encoded = os.fsencode(text)
    except UnicodeError:
        return "cannot be written as a file name on this system (characters the file " \
               "system encoding cannot hold)"
    if len(encoded) > PATH_MAX_BYTES:
        return f"is longer than the {PATH_MAX_BYTES} bytes a path may have"
    if any(len(part) > NAME_MAX_BYTES for part in encoded.split(b"/")):
        return f"has a name longer than the {NAME_MAX_BYTES} bytes a file name may have"
    return None


@dataclass(frozen=True)
class FilePath(Text):
    """A file or directory path: text that can name a file here (no NUL, within the limits)."""

    def check(self, value: Any, source: str, key: str) -> str:
        text = Text.check(self, value, source, key)
        problem = path_problem(text)
        if problem:
            raise ConfigError(source, key, f"{show(value)} {problem}",
                              f"write a path the file system can hold, e.g. {_leaf(key)}: "
                              f"{self.example}")
        return text


@dataclass(frozen=True)
class Choice(Field):
    choices: tuple[str, ...] = ()
    noun: str = ""  # "metric": the message says "unknown metric 'x'"

    def check(self, value: Any, source: str, key: str) -> str:
        if isinstance(value, str) and value in self.choices:
            return value
        options = ", ".join(self.choices)
        problem = f"unknown {self.noun} {show(value)}" if self.noun else \
            f"{show(value)} is not one of {options}"
        raise ConfigError(source, key, problem,
                          f"use one of: {options}{did_you_mean(value, self.choices)}")

    def schema(self) -> dict[str, Any]:
        return {"enum": list(self.choices)}


@dataclass(frozen=True)
class Template(FilePath):
    """A path with `{name}` placeholders from `allowed` only: no format specs, no others."""
    allowed: tuple[str, ...] = ("rank", "job_name")

    def check(self, value: Any, source: str, key: str) -> str:
        text = FilePath.check(self, value, source, key)  # non-blank, bounded, a possible path
        names = ", ".join(f"{{{a}}}" for a in self.allowed)
        fix = f"use only {names} as placeholders (write {{{{ and }}}} for literal braces)"
        try:
            parts = list(string.Formatter().parse(text))
        except ValueError as exc:  # a lone { or }
            raise ConfigError(source, key, f"{show(value)}: {exc}", fix) from None
        for _, name, spec, conversion in parts:
            if name is None:
                continue
            if name not in self.allowed:
                raise ConfigError(source, key, f"{show(value)} has the placeholder {{{name}}}", fix)
            if spec or conversion:
                raise ConfigError(source, key, f"{show(value)} formats {{{name}}} "
                                  f"({f'!{conversion}' if conversion else f':{spec}'})",
                                  f"write plain {{{name}}}, without a format")
        return text

    def schema(self) -> dict[str, Any]:
        names = "|".join(re.escape(a) for a in self.allowed)
        return {"type": "string", "maxLength": self.max_length, "not": NUL_SCHEMA,
                "allOf": [{"pattern": r"\S"},
                          {"pattern": rf"^(?:[^{{}}]|\{{\{{|\}}\}}|\{{(?:{names})\}})*$"}]}


@dataclass(frozen=True)
class Url(Field):
    """An http(s) URL with a host; `refuse` maps a regex on the path to the reason it is wrong."""
    refuse: tuple[tuple[str, str], ...] = ()
    example: str = "http://host:port"

    def check(self, value: Any, source: str, key: str) -> str:
        problem = "is not a URL"
        if isinstance(value, str) and len(value) <= 2048:
            try:
                parts = urlsplit(value)
                ok = parts.scheme in ("http", "https") and bool(parts.hostname) \
                    and (parts.port is None or parts.port > 0) \
                    and not any(c.isspace() or c in _CONTROL for c in value)
            except ValueError:  # a port that is not a number, or out of range
                ok = False
            for pattern, reason in self.refuse:
                if ok and re.search(pattern, parts.path):
                    ok, problem = False, reason
            if ok:
                return value
        shown = show(redact_url(value)) if isinstance(value, str) else show(value)
        raise ConfigError(source, key, f"{shown} {problem}",
                          f"write an http:// or https:// URL with a host, e.g. "
                          f"{_leaf(key)}: {self.example}")

    def schema(self) -> dict[str, Any]:
        authority = r"(?:[^\s/?#@]+@)?(?:\[[0-9A-Fa-f:.]+\]|[^\s/?#@:\[\]]+)(?::[0-9]{1,5})?"
        out: dict[str, Any] = {"type": "string", "maxLength": 2048,
                               "pattern": rf"^https?://{authority}(?:[/?#]\S*)?$"}
        out["not"] = {"anyOf": [{"pattern": p} for p, _ in self.refuse]
                      + [{"pattern": "[\\u0000-\\u001f\\u007f]"}]}
        return out


@dataclass(frozen=True)
class StringMap(Field):
    """key: value pairs of scalars (values become text); `reserved` keys are refused."""
    reserved: tuple[str, ...] = ()
    reason: str = ""
    secret: bool = False  # values are credentials (headers): never shown

    def check(self, value: Any, source: str, key: str) -> dict[str, str]:
        if not isinstance(value, Mapping):
            raise ConfigError(source, key, f"{show(value)} is not a mapping",
                              f"write {_leaf(key)} as key: value pairs")
        problems, out = Problems(), {}
        for name, item in value.items():
            if problems.full:
                problems.truncated = True
                break
            if not isinstance(name, str) or not name.strip():
                problems.add(ConfigError(source, f"{key}.{show(name)}", "the name is not text",
                                         "use text names"))
            elif name in self.reserved:
                problems.add(ConfigError(source, f"{key}.{name}", self.reason,
                                         f"remove {name} from {_leaf(key)}"))
            elif isinstance(item, bool) or not isinstance(item, (str, int, float)):
                shown = "the value" if self.secret or is_secret_name(name) else show(item)
                problems.add(ConfigError(source, f"{key}.{name}", f"{shown} is not a text "
                                         "or number", f"write {name}: a single value"))
            else:
                out[name] = str(item)
        problems.raise_if_any()
        return out

    def schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "object", "additionalProperties":
                               {"type": ["string", "number"]},
                               "propertyNames": {"pattern": r"\S"}}
        if self.reserved:
            out["propertyNames"] = {"pattern": r"\S", "not": {"enum": list(self.reserved)}}
        return out


@dataclass(frozen=True)
class ListOf(Field):
    """A non-empty list of `item`s (duplicates dropped); `comma`: "a, b" is the list [a, b]."""
    item: Field = field(default_factory=Field)
    comma: bool = False
    empty: bool = False  # [] allowed
    fix: str = ""

    def check(self, value: Any, source: str, key: str) -> tuple[Any, ...]:
        items = value
        if self.comma and isinstance(value, str):
            items = [part.strip() for part in value.split(",")]
        if not isinstance(items, (list, tuple)) or not (items or self.empty):
            raise ConfigError(source, key, f"{show(value)} is not a non-empty list", self.fix)
        problems, out = Problems(), []
        for i, item in enumerate(items):
            if problems.full:
                problems.truncated = True
                break
            try:
                checked = self.item.check(item, source, f"{key}[{i}]")
            except ConfigError as exc:
                problems.add(exc)
                continue
            if checked not in out:
                out.append(checked)
        problems.raise_if_any()
        return tuple(out)

    def schema(self) -> dict[str, Any]:
        array = {"type": "array", "items": self.item.schema(), "minItems": 0 if self.empty else 1}
        if self.comma:
            word = (("(?:" + "|".join(re.escape(c) for c in self.item.choices) + ")")
                    if isinstance(self.item, Choice) else r"[^,\s](?:[^,]*[^,\s])?")
            text = {"type": "string", "pattern": rf"^\s*{word}(?:\s*,\s*{word})*\s*$"}
            return {"anyOf": [array, text]}
        return array


@dataclass(frozen=True)
class Ranks(Field):
    """A rank or a list of ranks (sorted, unique); `every`: -1 or "all" means every rank (None)."""
    every: bool = False
    fix: str = "use a rank (0) or a list of ranks ([0, 8])"

    def check(self, value: Any, source: str, key: str) -> tuple[int, ...] | None:
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        if self.every and (value == "all" or any(_is_number(i) and i == -1 for i in items)):
            return None
        ranks = [int(i) if isinstance(i, float) and i.is_integer() else i for i in items]
        if not ranks or not all(isinstance(r, int) and not isinstance(r, bool)
                                and 0 <= r <= MAX_COUNT for r in ranks):
            hint = _unquoted_hint(self, value, key, whole=True) if isinstance(value, str) else ""
            raise ConfigError(source, key, f"{show(value)} is not a rank or a list of ranks",
                              self.fix + hint)
        return tuple(sorted(set(ranks)))

    def schema(self) -> dict[str, Any]:
        rank = {"type": "integer", "minimum": -1 if self.every else 0, "maximum": MAX_COUNT}
        forms: list[dict[str, Any]] = [rank, {"type": "array", "items": rank, "minItems": 1}]
        return {"anyOf": forms + ([{"const": "all"}] if self.every else [])}


@dataclass(frozen=True)
class Optional(Field):
    """`inner`, or null (YAML `null` / `~` / nothing)."""
    inner: Field = field(default_factory=Field)

    def check(self, value: Any, source: str, key: str) -> Any:
        if value is None:
            return None
        inner = replace(self.inner, why=self.why) if self.why else self.inner  # for the fix
        return inner.check(value, source, key)

    def schema(self) -> dict[str, Any]:
        return {"anyOf": [self.inner.schema(), {"type": "null"}]}


@dataclass(frozen=True)
class Constraint:
    """A rule across keys of one section: `check(section_value, raw_mapping, source, prefix)`
    raises ConfigError; `schema` is the same rule in JSON Schema (an `allOf` item)."""
    check: Callable[[Any, Mapping[str, Any], str, str], None]
    schema: dict[str, Any]


@dataclass(frozen=True)
class Section(Field):
    """A mapping of known keys, read into the dataclass `cls`; unknown keys: did-you-mean.

    Every problem of the mapping (and of nested sections) is reported, not only the first.
    """
    cls: type = object
    keys: Mapping[str, Field] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)
    constraints: tuple[Constraint, ...] = ()
    nullable: bool = True  # `output:` with nothing under it means the defaults

    def check(self, value: Any, source: str, key: str) -> Any:
        if value is None and self.nullable:
            return self.cls()
        if not isinstance(value, Mapping):
            raise ConfigError(source, key, f"{show(value)} is not a mapping",
                              f"indent the {_leaf(key)} keys under it as key: value pairs")
        problems, values = Problems(), {}
        known = (*self.keys, *self.aliases)
        seen: set[str] = set()
        for raw, item in value.items():
            if problems.full:
                problems.truncated = True
                break
            name = self.aliases.get(str(raw), str(raw))
            at = f"{key}.{raw if isinstance(raw, str) else show(raw)}"
            if name in seen:
                problems.add(ConfigError(source, at, f"{name!r} is given twice (once through "
                                         "an alias)", f"keep only {name}"))
            elif name not in self.keys:
                problems.add(ConfigError(source, at, "unknown key",
                                         f"remove it or use a known key{did_you_mean(raw, known)}; "
                                         f"known keys: {', '.join(sorted(self.keys))}"))
            else:
                seen.add(name)
                try:
                    values[name] = self.keys[name].check(item, source, at)
                except ConfigError as exc:
                    problems.add(exc)
        problems.raise_if_any()
        result = self.cls(**values)
        for constraint in self.constraints:
            problems.run(constraint.check, result, value, source, key)
        problems.raise_if_any()
        return result

    def schema(self) -> dict[str, Any]:
        defaults = self.cls() if self.cls is not object else None
        properties = {name: f.described(getattr(defaults, name, None)) if defaults is not None
                      else f.described() for name, f in self.keys.items()}
        for alias, name in self.aliases.items():
            properties[alias] = {**properties[name], "description":
                                 f"alias of {name}: " + properties[name].get("description", "")}
        out: dict[str, Any] = {"type": ["object", "null"] if self.nullable else "object",
                               "properties": properties, "additionalProperties": False}
        rules = [c.schema for c in self.constraints]
        rules += [{"not": {"required": [alias, name]}} for alias, name in self.aliases.items()]
        if rules:
            out["allOf"] = rules
        return out
