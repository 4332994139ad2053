"""README's Layout section names every module of the package, so it cannot fall behind the tree."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_readme_layout_names_every_module():
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Layout"):]
    listing = section.split("```")[1]
    named = set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", listing))
    modules = {p.stem for p in (REPO / "dflash_train").rglob("*.py")} - {"__init__", "__main__"}
    assert not modules - named, f"modules missing from README's Layout: {sorted(modules - named)}"
    for folder in re.findall(r"^  (\w+)/", listing, flags=re.M):
        assert (REPO / "dflash_train" / folder).is_dir(), folder
