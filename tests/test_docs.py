"""The README is a front door: about 200 lines, its quick start is what .ci/run runs, its links resolve."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_length_links_and_quick_start():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 220
    assert max(len(line) for line in text.splitlines() if not line.startswith("|")) <= 115
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert links and all((ROOT / link).is_file() for link in links if not link.startswith("http")), links
    for page in ("BENCHMARKS", "DRIVES", "SERVING", "JOBS", "DISTRIBUTED", "KERNELS", "DESIGN"):
        assert f"docs/{page}.md" in text
    quick = text.split("## Quick start", 1)[1].split("```")[1].strip().splitlines()
    assert quick == ['pip install -e . && deltafin demo', 'pip install -e ".[test]" && python -m pytest -q']
    assert quick[1] in (ROOT / ".ci" / "run").read_text()


def test_docs_links_resolve():
    for page in (ROOT / "docs").glob("*.md"):
        for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if not link.startswith("http"):
                assert (page.parent / link).is_file(), (page.name, link)
