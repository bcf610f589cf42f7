"""Where the repository's files are, for tests in any folder."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
FIXTURES = TESTS / "fixtures"
SUPPORT = TESTS / "support"
