"""`ppoflow config-reference`: the config fields as a Markdown table (ppoflow/reference.py)."""

from __future__ import annotations


def cmd_config_reference(args) -> int:
    from ppoflow.reference import config_reference_markdown

    print(config_reference_markdown())
    return 0


def add_config_reference(subparsers) -> None:
    ref = subparsers.add_parser("config-reference", help="print the config reference (Markdown)")
    ref.set_defaults(func=cmd_config_reference)
