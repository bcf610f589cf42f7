"""The docs hold together: every relative link and `#anchor` in the repository's Markdown resolves
(GitHub's heading slugs), no page cites a path outside the repository, and the README stays a
first-hour page whose set-up commands are the Makefile's.
"""
from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

import pytest

from tests.support.paths import ROOT

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t#]*$", re.M)
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)
# a path written in the text that climbs out of its folder: `../shared/DESIGN.md`, ../../x
CLIMB = re.compile(r"(?<![\w./-])((?:\.\./)+[\w.-][\w./-]*)")
# a file of the repository named in the text: `tests/e2e/test_x.py`, benchmarks/scrape.py
REPO_PATH = re.compile(
    r"(?<![\w./:-])((?:tests|benchmarks|examples|scripts)/[\w./-]*\.(?:py|ya?ml|sh))\b")


def markdown_files() -> list[Path]:
    """Every Markdown file of the checkout (tracked, or new and not ignored)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                             "*.md"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    return [ROOT / name for name in listed]


def prose(text: str) -> str:
    """The text without fenced code blocks (a `# comment` in a shell block is no heading)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation but `-` and `_`
    removed, each space a `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)    # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a page has: its headings' slugs (repeats get -1, -2, ...), HTML anchors."""
    text = prose(path.read_text())
    found: set[str] = set(HTML_ANCHOR.findall(text))
    seen: dict[str, int] = {}
    for match in HEADING.finditer(text):
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    return [target for target in LINK.findall(prose(path.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", target, re.I)]   # http:, mailto: ...


def test_slugs_follow_github():
    assert slug("Quick start: plain MindSpore") == "quick-start-plain-mindspore"
    assert slug("The `/metrics` endpoint") == "the-metrics-endpoint"
    assert slug("5. Past one Prometheus: shards, federation, remote_write") == \
        "5-past-one-prometheus-shards-federation-remote_write"
    assert slug("Where it binds, who can see it") == "where-it-binds-who-can-see-it"


def test_anchors_skip_code_blocks_and_number_repeats(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# A\n\n```sh\n# not a heading\n```\n\n## Notes\n\n## Notes\n")
    assert anchors(page) == {"a", "notes", "notes-1"}


def test_links_skip_urls_and_code(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("[a](docs/x.md#y) [b](https://e.org/z) ![i](img/p.png)\n"
                    "```\n[c](nowhere.md)\n```\n")
    assert links(page) == ["docs/x.md#y", "img/p.png"]


def test_the_pages_users_read_are_checked():
    names = {p.relative_to(ROOT).as_posix() for p in markdown_files()}
    assert {"README.md", "prometheus/runbook.md", "examples/mindformers/README.md",
            "docs/configuration.md", "docs/metrics.md", "docs/alerting.md", "docs/security.md",
            "docs/performance.md", "docs/live-page.md", "docs/logs.md", "docs/otel.md",
            "docs/lifecycle.md", "docs/scaling.md"} <= names


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_and_anchor_resolves(path: Path):
    broken = []
    for target in links(path):
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
        elif not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.relative_to(ROOT)}")
    assert not broken, f"{path.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_page_cites_a_path_outside_the_repository(path: Path):
    text = path.read_text()
    outside = [p for p in CLIMB.findall(text)
               if not (path.parent / p).resolve().is_relative_to(ROOT)]
    outside += re.findall(r"/work/\S+|\bshared/(?:DESIGN|STYLE)\.md", text)
    assert not outside, f"{path.relative_to(ROOT)} cites {outside}"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_repository_files_a_page_names_exist(path: Path):
    """A test, benchmark, example or script a page names is where it says (files move)."""
    missing = sorted({p for p in REPO_PATH.findall(path.read_text()) if not (ROOT / p).is_file()})
    assert not missing, f"{path.relative_to(ROOT)} names files that do not exist: {missing}"


def test_the_readme_is_a_first_hour_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    first_block = readme.split("```sh\n", 1)[1].split("```", 1)[0]
    assert [line.split()[:2] for line in first_block.splitlines()] == \
        [["make", "demo"], ["make", "test"]]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    for section in ("Quick start: plain MindSpore", "Quick start: mindformers", "Live page",
                    "Where to go next"):
        assert f"\n## {section}\n" in readme
    assert "docs/images/live-page.png" in readme
    # every docs page is reachable from the README
    linked = {t.partition("#")[0] for t in links(ROOT / "README.md")}
    pages = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")}
    assert pages <= linked, pages - linked


TEST_NAME = re.compile(r"`(test_\w+)`")


@functools.cache
def defined_tests() -> frozenset[str]:
    """Every test function defined under tests/."""
    return frozenset(name for test_file in (ROOT / "tests").rglob("test_*.py")
                     for name in re.findall(r"^\s*(?:async\s+)?def (test_\w+)",
                                            test_file.read_text(), re.M))


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_tests_a_page_names_exist(path: Path):
    """A test a page names as proof (`test_forged_webhooks_get_401_and_change_nothing`) is
    defined in tests/ (tests are renamed and moved too)."""
    named = set(TEST_NAME.findall(path.read_text()))
    if not named:
        return
    missing = sorted(named - defined_tests())
    assert not missing, f"{path.relative_to(ROOT)} names tests that do not exist: {missing}"
