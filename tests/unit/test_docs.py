"""The documents a user gets stand on their own: no link leaves the repository or points at nothing."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_no_document_points_outside_the_repository():
    for doc in DOCS:
        assert "../shared" not in doc.read_text(), f"{doc.relative_to(REPO)} points outside the repository"


def test_relative_links_resolve():
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            path = (doc.parent / target).resolve()
            assert path.exists(), f"{doc.relative_to(REPO)} links to {target}, which does not exist"
            assert REPO in path.parents or path == REPO, f"{doc.relative_to(REPO)} links outside: {target}"


def test_the_design_document_is_in_the_repository_and_linked():
    assert (REPO / "docs" / "design.md").is_file()
    assert "docs/design.md" in (REPO / "README.md").read_text()
