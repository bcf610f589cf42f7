"""ConfigError: one or several problems, each naming the file, the key path, the value and the
fix."""
from __future__ import annotations

import difflib
import reprlib
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

_T = TypeVar("_T")

#: Longest excerpt of a bad value shown in a message (a 4 MB string must not become the message).
SHOW_CHARS = 80


class ConfigError(ValueError):
    """A bad monitor configuration; the message says where and how to fix it.

        ConfigError("train.yaml", "monitor_config.step_interval", "0 is not ...", "use ...")

    Several problems of one document travel in one ConfigError (`errors`, one line each);
    `source`, `key`, `problem` and `fix` are those of the first.
    """

    def __init__(self, source: str, key: str | None = None, problem: str = "",
                 fix: str = "", errors: Iterable[ConfigError] = ()) -> None:
        self.source, self.key, self.problem, self.fix = source, key, problem, fix
        self.errors: list[ConfigError] = list(errors) or [self]
        if len(self.errors) > 1:
            message = "\n".join(str(e) for e in self.errors)
        elif key is None:  # one argument: an already formatted message (`type(e)(str(e))`)
            message = source
        else:
            message = f"{source}: {key}: {problem}. Fix: {fix}"
        super().__init__(message)

    @classmethod
    def of(cls, errors: list[ConfigError]) -> ConfigError:
        """One ConfigError carrying every problem of `errors` (flattened, in order)."""
        flat = [leaf for error in errors for leaf in error.errors]
        first = flat[0]
        return cls(first.source, first.key, first.problem, first.fix, errors=flat)


#: Problems listed per document: a document with thousands of bad values must not cost
#: thousands of messages (and their did-you-mean searches); one more line says so.
MAX_PROBLEMS = 20


class Problems:
    """Collects the ConfigErrors of one document, so that all are reported at once (the
    first MAX_PROBLEMS of them: loops stop checking once `full`).

        problems = Problems()
        problems.run(check_one_key, ...)
        problems.raise_if_any()
    """

    def __init__(self) -> None:
        self.errors: list[ConfigError] = []
        self.truncated = False   # problems were left out

    @property
    def full(self) -> bool:
        """No further problem will be listed: callers stop looking (and set `truncated`)."""
        return len(self.errors) >= MAX_PROBLEMS

    def add(self, error: ConfigError) -> None:
        for leaf in error.errors:
            if self.full:
                self.truncated = True
                return
            self.errors.append(leaf)

    def run(self, call: Callable[..., _T], *args: Any, **kwargs: Any) -> _T | None:
        """`call(*args)`; a ConfigError is recorded and None returned."""
        try:
            return call(*args, **kwargs)
        except ConfigError as exc:
            self.add(exc)
            return None

    def raise_if_any(self) -> None:
        if not self.errors:
            return
        if self.truncated:
            last = self.errors[-1]
            self.errors.append(ConfigError(last.source, last.key, f"more problems follow; "
                                           f"only the first {MAX_PROBLEMS} are listed",
                                           "fix these, then check again"))
        raise ConfigError.of(self.errors)


_REPR = reprlib.Repr()  # bounded depth and width, whatever the value
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxtuple = 3, 4, 4, 4
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = SHOW_CHARS - 20, SHOW_CHARS - 20, 40


def show(value: Any) -> str:
    """A short repr of `value`: huge or deeply nested values must not become the message."""
    text = _REPR.repr(value)
    return text if len(text) <= SHOW_CHARS else text[:SHOW_CHARS - 1] + "…"


def did_you_mean(word: Any, choices: Iterable[Any]) -> str:
    """` (did you mean 'x'?)` for the closest of `choices`, else ''."""
    word = str(word)[:SHOW_CHARS]
    names = [str(c) for c in choices]
    same = [name for name in names if name.lower() == word.lower()]  # JSON for json
    close = same or difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
