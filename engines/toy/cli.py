"""The command line every toy builder shares: `python -m engines.toy.<builder> OUT [--FLAG N ...]`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, Optional, Sequence


def toy_main(doc: str, build: Callable[..., Path], options: dict[str, str], argv: Optional[Sequence[str]]) -> None:
    """Parse `OUT` and the integer `options` (flag -> keyword argument of `build`), call `build(OUT, ...)` and
    print the path it returns. A flag left out is not passed, so `build`'s own default applies."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the folder or file to write")
    for flag, keyword in options.items():
        p.add_argument(flag, type=int, dest=keyword, help=f"{keyword} (default: the builder's)")
    args = vars(p.parse_args(argv))
    out = args.pop("out")
    print(build(out, **{keyword: value for keyword, value in args.items() if value is not None}))
