"""Every YAML and Python block of README.md and docs/ still works with the code as it is (tests/fixtures/docs.py
has the conventions): YAML blocks load with the config loader; every Python block is named and run by the test
that names it (with the run, shards or server it needs). A renamed config field, a removed module or a changed
contract fails here.
"""

from __future__ import annotations

import re

import pytest
import yaml

from ppoflow.config import load_config
from tests.fixtures.docs import REPO, Block, all_blocks, named_block

YAML_BLOCKS = all_blocks("yaml")
PYTHON_BLOCKS = all_blocks("python")


def _merge(base: dict, fragment: dict) -> dict:
    """`fragment` over `base`, mapping by mapping (a list or a value in the fragment replaces the base's)."""
    out = dict(base)
    for key, value in fragment.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def config_text(block: Block) -> str:
    """The YAML the loader reads for `block`: the block itself, or its base with the block merged in."""
    directive = block.directive or ""
    if not directive.startswith("fragment of "):
        return block.text
    base_name = directive.removeprefix("fragment of ").strip()
    base_path = REPO / base_name
    base_text = base_path.read_text() if base_path.is_file() else config_text(named_block(base_name))
    return yaml.safe_dump(_merge(yaml.safe_load(base_text) or {}, yaml.safe_load(block.text) or {}))


@pytest.mark.parametrize("block", YAML_BLOCKS, ids=[b.where for b in YAML_BLOCKS])
def test_yaml_block_loads_with_the_config_loader(block, tmp_path):
    if block.directive == "not a config":
        yaml.safe_load(block.text)  # still YAML
        return
    path = tmp_path / "block.yaml"
    path.write_text(config_text(block))
    load_config(path)  # ConfigError names the field (and, with the test id, the page and line)


def test_the_docs_hold_yaml_blocks_and_fragments():
    # the parametrized test above must have something to check: the pages that promise a config show one
    files = {b.file for b in YAML_BLOCKS}
    assert {"docs/your-own-run.md", "docs/real-model.md", "docs/storage.md", "docs/multi-turn.md"} <= files
    assert any((b.directive or "").startswith("fragment of ") for b in YAML_BLOCKS)


def test_every_python_block_is_named_and_run_by_a_test():
    # a Python example needs its context (a run, shards, a server, a model), so the test that has it runs it
    unnamed = [b.where for b in PYTHON_BLOCKS if b.name is None]
    assert not unnamed, f"Python blocks without <!-- NAME:start --> markers (no test runs them): {unnamed}"
    tests = "\n".join(p.read_text() for p in (REPO / "tests").rglob("test_*.py"))
    named = {b.name for b in PYTHON_BLOCKS}
    assert {"duckdb-local", "duckdb-s3", "your-run-python"} <= named
    missing = sorted(n for n in named if f'"{n}"' not in tests)
    assert not missing, f"named Python blocks no test runs: {missing}"


def test_the_your_own_run_reward_function_follows_openrlhfs_contract(tmp_path):
    namespace: dict = {}
    exec(compile(named_block("your-run-reward").text, "docs/your-own-run.md", "exec"), namespace)
    # two samples of the prompt "repeat 3 :": the first response holds the label as a word, the second does not
    rewards = namespace["reward_func"](["repeat 3 : 3 3", "repeat 3 : 33 x"], ["repeat 3 :"] * 2, ["3", "3"])
    assert rewards == [1.0, 0.0]


def test_a_broken_block_is_reported_with_its_page_and_line(tmp_path):
    # the loader's refusal reaches the test: an unknown field in a copy of the your-own-run config fails
    block = named_block("your-run-config")
    broken = block.text.replace("n_samples: 8", "n_sample: 8")
    assert broken != block.text
    path = tmp_path / "block.yaml"
    path.write_text(broken)
    with pytest.raises(Exception, match=r"rollout\.n_sample"):
        load_config(path)
    assert block.where.startswith("docs/your-own-run.md:")


@pytest.mark.parametrize(
    "readme, page",
    [
        ("readme-run-config", "your-run-config"),
        ("readme-run-reward", "your-run-reward"),
        ("readme-run-python", "your-run-python"),
    ],
)
def test_the_readme_shows_what_the_your_own_run_page_runs(readme, page):
    # tests/integration/test_docs_commands.py runs the page's blocks; the README's copies must be the same text
    assert named_block(readme).text == named_block(page).text


def test_the_readme_is_a_landing_page_and_its_links_resolve():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    for command in ("make demo", "make test", "make demo-real"):
        assert f"    {command}\n" in readme, command
    for page in ("README.md", "BENCHMARKS.md", "CHANGELOG.md"):
        text = (REPO / page).read_text()
        targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
        missing = [t for t in targets if "://" not in t and not (REPO / t).exists()]
        assert not missing, f"{page} links to files that are not there: {missing}"
