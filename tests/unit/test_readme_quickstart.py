"""The README's quick start says what a copied block does: every default it states is the one
`monitor_config: {}` gets. (That a copied block leaves every OTEL_* variable in force is
tests/unit/test_otel_env.py; a real run of the quick start is
tests/e2e/test_readme_quickstart_e2e.py.)"""
from __future__ import annotations

import re
from typing import Any

import yaml

from mfotel.config import parse_config
from tests.support.paths import ROOT

README = (ROOT / "README.md").read_text()
QUICK_START = README.split("## Quick start: plain MindSpore", 1)[1].split("\n## ", 1)[0]


def _setting(path: str, value: Any) -> Any:
    """The effective setting `path` (e.g. output.console) of a block holding only it."""
    cfg: Any = parse_config(_nested(path, value) if value is not None else {})
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _nested(path: str, value: Any) -> dict[str, Any]:
    head, _, rest = path.partition(".")
    return {head: _nested(rest, value) if rest else value}


def stated_defaults() -> list[tuple[str, Any]]:
    """(key path, default) of each written key of the quick start's block whose comment
    says `# default X`."""
    [block] = [b for b in re.findall(r"```yaml\n(.*?)```", QUICK_START, re.S)
               if "monitor_config:" in b]
    found, parents = [], []
    for line in block.splitlines()[1:]:
        written = re.match(r"( *)(\w+):(.*?)(?:#\s*default:?\s*(.+?)(?:[:;]\s.*)?)?$", line)
        if not written or line.lstrip().startswith("#"):
            continue
        depth = (len(written[1]) - 2) // 2
        parents[depth:] = [written[2]]
        if written[4] is not None:
            found.append((".".join(parents), yaml.safe_load(written[4])))
    return found


def test_every_default_the_block_states_is_the_default():
    stated = dict(stated_defaults())
    assert set(stated) == {"step_interval", "metrics", "output.console", "output.file",
                           "output.file_path", "log_rank"}   # every key written in the block
    for path, default in stated.items():
        assert _setting(path, None) == _setting(path, default), (path, default)


def test_the_empty_block_does_what_the_quick_start_says():
    sentence = re.search(r"`monitor_config: \{\}` records(.*?)A real", QUICK_START, re.S)
    assert sentence, "the quick start no longer says what monitor_config: {} does"
    said = dict(re.findall(r"`(\w+): ([^`]+)`", sentence[1]))
    assert said == {"step_interval": "1", "metrics": "[loss, learning_rate]"}
    for key, value in said.items():
        assert _setting(key, None) == _setting(key, yaml.safe_load(value)), key
    cfg = parse_config({})
    assert "on rank 0" in sentence[1] and cfg.log_rank == (0,) and cfg.output.console
    assert "port 9464 + local rank" in sentence[1] and cfg.prometheus.port == 9464
