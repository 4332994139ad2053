"""Every relative link in README.md, docs/ and results/ markdown resolves to a file or folder of the checkout."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def markdown_files():
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "results").rglob("*.md"))]


def broken_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # links inside code blocks are not links
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http(s)://, mailto: and in-page anchors
        file = target.split("#", 1)[0]
        if not (path.parent / file).exists():
            bad.append(target)
    return bad


def test_relative_markdown_links_resolve():
    files = markdown_files()
    assert len(files) > 10
    broken = {str(p.relative_to(REPO)): b for p in files if (b := broken_links(p))}
    assert not broken, f"links to nothing: {broken}"


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.json").write_text("{}")
    page.write_text("[ok](there.json) [anchor](#x) [web](https://example.com) [gone](missing/run.json#l2)\n")
    assert broken_links(page) == ["missing/run.json#l2"]
