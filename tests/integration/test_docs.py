"""The documentation: the site builds in strict mode (a broken link, a missing page or an unknown anchor fails),
the README stays short and its links resolve, and no user-facing text reads like a lab notebook."""
import glob
import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# development history has no place in what users read: issue numbers, closing notes, the design notes that live
# outside the repository, commit hashes
NOTEBOOK = re.compile(r"\bissue \d+|closing note|found on the way|FACTS\.md|ARCHITECTURE\.md|\bcommit [0-9a-f]{7,40}\b",
                      re.IGNORECASE)


def _slug(heading: str) -> str:
    """The anchor MkDocs' toc extension gives a heading."""
    text = re.sub(r"[`*_]", "", heading).strip().lower()
    text = re.sub(r"[^\w\s-]", "", text)
    return re.sub(r"[\s]+", "-", text)


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
                    reason="mkdocs / mkdocs-material not installed (pip install -e '.[docs]')")
def test_the_site_builds_strict(tmp_path, monkeypatch):
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")
    cfg = load_config(os.path.join(ROOT, "mkdocs.yml"), site_dir=str(tmp_path / "site"), strict=True)
    build(cfg)  # strict: any warning (broken link, page missing from the nav, unknown anchor) aborts
    pages = sorted(glob.glob(str(tmp_path / "site" / "**" / "index.html"), recursive=True))
    assert len(pages) == len(glob.glob(os.path.join(ROOT, "docs", "*.md"))) >= 18


def test_a_broken_link_fails_the_strict_build(tmp_path, monkeypatch):
    """The check above can fail: the same build of a page with a link to nowhere aborts."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs / mkdocs-material not installed")
    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    from mkdocs.exceptions import Abort

    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# x\n\n[gone](nowhere.md)\n")
    yml = tmp_path / "mkdocs.yml"
    text = open(os.path.join(ROOT, "mkdocs.yml")).read().split("\nnav:")[0]
    yml.write_text(text + "\nnav:\n  - Home: index.md\n")
    with pytest.raises(Abort):
        build(load_config(str(yml), site_dir=str(tmp_path / "site"), strict=True))


def test_the_readme_is_short_and_its_links_resolve():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert len(readme.splitlines()) <= 150
    for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#([^)]+))?\)", readme):
        path, anchor = target
        if path.startswith("http"):
            continue
        full = os.path.join(ROOT, path)
        assert os.path.isfile(full), path
        if anchor:
            heads = [_slug(h) for h in re.findall(r"^#+ (.+)$", open(full, encoding="utf-8").read(), re.M)]
            assert anchor in heads, (path, anchor, heads)


def test_no_user_facing_text_reads_like_a_lab_notebook():
    files = [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md")),
             *glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"), recursive=True),
             *glob.glob(os.path.join(ROOT, "slurm", "*.sh")),
             *glob.glob(os.path.join(ROOT, "esopt_mp", "**", "*.py"), recursive=True),
             *glob.glob(os.path.join(ROOT, "launch", "*.py")), *glob.glob(os.path.join(ROOT, "tools", "**", "*.py"),
                                                                          recursive=True)]
    found = []
    for path in files:
        for n, line in enumerate(open(path, encoding="utf-8"), 1):
            if NOTEBOOK.search(line):
                found.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()[:100]}")
    assert found == []
    assert NOTEBOOK.search("see the closing note of issue 5")  # the pattern itself catches what it should
