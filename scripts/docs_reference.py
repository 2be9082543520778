"""Write the config reference table into docs/config-reference.md, between its markers, from the config model.

    python scripts/docs_reference.py      (or: make docs-reference)

tests/unit/test_docs_reference.py fails while the page and `ppoflow config-reference` differ; this is the fix.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "config-reference.md"
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def main() -> None:
    sys.path.insert(0, str(REPO))
    from ppoflow.reference import config_reference_markdown

    text = PAGE.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    PAGE.write_text(f"{head}{START}\n\n{config_reference_markdown().strip()}\n\n{END}{tail}")
    print(f"wrote {PAGE.relative_to(REPO)}")


if __name__ == "__main__":
    main()
