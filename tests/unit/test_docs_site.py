"""The docs site builds in strict mode (as `make docs` does), and strict mode fails on what it must: a broken link,
a page left out of the navigation, an include of a file that is not there.

The real site is built once into a temporary folder (a few seconds). The failure cases build a one-page site with
the repository's own mkdocs.yml settings (theme, validation, extensions), so what they show holds for the real one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
MKDOCS = [sys.executable, "-m", "mkdocs", "build", "--strict"]  # not --quiet: it drops the warnings strict counts
ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about its successor, not a warning


def _build(config: Path, site: Path, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*MKDOCS, "-f", str(config), "-d", str(site)], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300
    )


def test_the_docs_site_builds_in_strict_mode(tmp_path):
    result = _build(REPO / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    site = tmp_path / "site"
    for page in ("index.html", "your-own-run/index.html", "architecture/index.html", "search/search_index.json"):
        assert (site / page).is_file(), page
    # the plots the pages embed are in the site (docs/assets/results is bench/results)
    assert (site / "assets" / "results" / "peer_real_stage_seconds.png").is_file()


def _one_page_site(tmp_path: Path, page: str, extra_pages: dict[str, str] | None = None) -> Path:
    """A site with the repository's settings and the single nav entry index.md holding `page`."""
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(page)
    for name, text in (extra_pages or {}).items():
        (docs / name).write_text(text)
    config.update(docs_dir=str(docs), nav=[{"Home": "index.md"}])
    path = tmp_path / "mkdocs.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_strict_mode_fails_on_a_broken_link_a_broken_anchor_and_a_page_left_out_of_the_nav(tmp_path):
    # one build, three faults: strict mode reports every warning before it aborts
    page = "# Home\n\nSee [the guide](guide.md) and [a section](#no-such-heading).\n"
    result = _build(_one_page_site(tmp_path, page, {"orphan.md": "# Orphan\n"}), tmp_path / "site")
    output = result.stdout + result.stderr
    assert result.returncode != 0
    for fault in ("guide.md", "no-such-heading", "orphan.md"):
        assert fault in output, f"{fault} not reported:\n{output[-3000:]}"


def test_strict_mode_fails_on_an_include_of_a_missing_file(tmp_path):
    # the snippets extension stops at the first missing file (check_paths in mkdocs.yml)
    page = '# Home\n\n--8<-- "configs/no-such-file.yaml"\n'
    result = _build(_one_page_site(tmp_path, page), tmp_path / "site")
    assert result.returncode != 0
    assert "configs/no-such-file.yaml" in result.stdout + result.stderr
