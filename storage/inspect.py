"""What `ppoflow shards ls|show|stats URI` prints: rich tables over the shards under a URI.

URI may be a stage folder (…/iter-000003/rollout), an iteration folder, a run folder or any folder
above them; local paths and s3:// alike. A folder counts as a stage folder when it holds a
`_manifest.json` (committed) or `part-*.arrow` files without one (not committed). Only committed
folders are read by `show` and `stats`, through the same verified reader the pipeline uses.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import pyarrow as pa
import pyarrow.compute as pc
from rich.console import Group
from rich.table import Table
from rich.text import Text

from ppoflow.config import StorageConfig
from ppoflow.tables import FitTable
from storage import fs as fsutil
from storage.schema import check_columns
from storage.shards import MANIFEST_NAME, Manifest, read_manifest, read_part, require_manifest

_WIDE_COLUMNS = 6  # more columns than this are shown one row per block
_CELL_WIDTH = 48  # the widest a cell gets side by side
_MIN_CELL_WIDTH = 16  # side by side only when each column gets this much (or its name's width, or all it needs)


def find_stage_dirs(fs, path: str) -> dict[str, Optional[Manifest]]:
    """{stage folder: its manifest, or None when not committed} for every stage folder at or under `path`."""
    files = fsutil.list_files(fs, path)
    folders: set[str] = set()
    for rel in files:
        folder, _, name = ("/" + rel).rpartition("/")
        if name == MANIFEST_NAME or (name.startswith("part-") and name.endswith(".arrow")):
            folders.add(folder.lstrip("/"))
    return {
        fsutil.join(path, rel) if rel else path: read_manifest(fs, fsutil.join(path, rel) if rel else path)
        for rel in sorted(folders)
    }


def _stage_dirs_or_error(uri: str, storage_cfg: Optional[StorageConfig]):
    fs, path = fsutil.resolve(uri, storage_cfg)
    found = find_stage_dirs(fs, path)
    if not found:
        raise FileNotFoundError(f"no shards under {uri} (no _manifest.json and no part-*.arrow files)")
    return fs, path, found


def _relative(path: str, root: str) -> str:
    return path[len(root) :].lstrip("/") or "."


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def part_problems(fs, folder: str, manifest: Manifest) -> list[str]:
    """What is wrong with the parts a manifest lists, from one listing (no part is read): a part missing,
    or of another size than the manifest says (truncated or grown). Empty when every part is there whole.

    A part of the right size with other bytes passes here; `show` and `stats` check every hash they read.
    """
    sizes = fsutil.list_files(fs, folder)
    problems = []
    for part in manifest.parts:
        size = sizes.get(part.name)
        if size is None:
            problems.append(f"{part.name} missing")
        elif size < part.bytes:
            problems.append(f"{part.name} truncated: {size:,} of {part.bytes:,} bytes")
        elif size != part.bytes:
            problems.append(f"{part.name} has {size:,} bytes, manifest says {part.bytes:,}")
    return problems


def shards_ls(uri: str, storage_cfg: Optional[StorageConfig] = None, broken: Optional[list[str]] = None) -> FitTable:
    """One row per stage folder under `uri`: folder, kind, parts, rows, bytes, committed, check (a FitTable: every
    cell whole at any width, ppoflow/tables.py).

    `check` is "ok" or what `part_problems` found; the folders with a problem are appended to `broken`.
    """
    fs, root, found = _stage_dirs_or_error(uri, storage_cfg)
    columns = [
        ("folder", "left"),
        ("kind", "left"),
        ("parts", "right"),
        ("rows", "right"),
        ("bytes", "right"),
        ("committed", "center"),
        ("check", "left"),
    ]
    rows = []
    for folder, manifest in found.items():
        if manifest is None:
            parts = [n for n in fsutil.list_files(fs, folder) if n.startswith("part-")]
            rows.append([_relative(folder, root), "?", str(len(parts)), "?", "?", "[red]no[/red]", "-"])
            continue
        problems = part_problems(fs, folder, manifest)
        if problems and broken is not None:
            broken.append(fsutil.url_of(fs, folder))
        check = "[green]ok[/green]" if not problems else "[red]broken: " + "; ".join(problems) + "[/red]"
        rows.append(
            [
                _relative(folder, root),
                manifest.kind,
                str(len(manifest.parts)),
                f"{manifest.rows:,}",
                _human_bytes(manifest.bytes),
                "[green]yes[/green]",
                check,
            ]
        )
    return FitTable(f"shards under {uri}", columns, rows)


def describe_metadata(schema: pa.Schema) -> str:
    """The ppoflow.* schema metadata of a part as "key=value" pairs ("" when it has none)."""
    meta = {k.decode(): v.decode() for k, v in (schema.metadata or {}).items() if k.startswith(b"ppoflow.")}
    return ", ".join(f"{k[len('ppoflow.') :]}={v}" for k, v in meta.items())


def _cell(value: Any, width: int = _CELL_WIDTH) -> str:
    """`value` on one line of at most `width` characters: a list as its length and first elements, a newline
    as ⏎ and a tab as a space (a chat-template prompt has many lines), the rest cut with …."""
    if isinstance(value, list):
        head = ", ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in value[:8])
        text = f"[{len(value)}] {head}{', …' if len(value) > 8 else ''}"
    elif isinstance(value, float):
        text = f"{value:.4g}"
    else:
        text = str(value).replace("\r\n", "⏎").replace("\n", "⏎").replace("\r", "⏎").replace("\t", " ")
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def shards_show(
    uri: str, rows: int = 10, columns: Optional[Sequence[str]] = None, storage_cfg: Optional[StorageConfig] = None
):
    """The first `rows` rows of one committed stage folder (only `columns` when given), as a rich renderable.

    Lists show their length then the first elements ("[12] 5, 9, …"), newlines show as ⏎; the layout follows
    the console's width (ShardRows). Raises ValueError listing the stage folders when `uri` holds several,
    NotCommittedError when it is not committed.
    """
    fs, root, found = _stage_dirs_or_error(uri, storage_cfg)
    if len(found) > 1:
        raise ValueError(
            f"{uri} holds {len(found)} stage folders; show one of: " + ", ".join(_relative(f, root) for f in found)
        )
    folder = next(iter(found))
    manifest = require_manifest(fs, folder)
    selected = check_columns(manifest.kind, columns)
    pieces, taken = [], 0
    for part in manifest.parts:
        if taken >= rows:
            break
        piece = read_part(fs, folder, part, manifest.kind).slice(0, rows - taken)
        pieces.append(piece.select(selected) if selected else piece)
        taken += piece.num_rows
    data = pa.concat_tables(pieces) if pieces else None
    title = f"{fsutil.url_of(fs, folder)} ({manifest.kind}, first {taken} of {manifest.rows:,} rows)"
    caption = describe_metadata(pieces[0].schema) if pieces else ""
    names = list(selected or (data.column_names if data is not None else []))
    records = data.to_pylist() if data is not None else []
    return ShardRows(title, names, records, caption)


class ShardRows:
    """Rows of a stage folder laid out for the width they are printed at (a rich renderable).

    Side by side when there are at most _WIDE_COLUMNS columns and each gets at least its name's width and
    _MIN_CELL_WIDTH (less when all its cells are narrower), cells cut with …; otherwise one block per row, a
    `name  value` line per column (like psql's \\x). Either way every column's name is shown whole and no line
    is wider than the console (an 80-column terminal, or a pipe, which rich takes as 80).
    """

    def __init__(self, title: str, names: list[str], records: list[dict[str, Any]], caption: str):
        self.title, self.names, self.records, self.caption = title, names, records, caption

    def __rich_console__(self, console, options):
        widths = self._column_widths(options.max_width) if len(self.names) <= _WIDE_COLUMNS else None
        yield self._table(widths) if widths else self._blocks(options.max_width)
        if self.caption:  # on a line of its own: a table caption would wrap at a narrow table's width
            yield Text(f"part metadata: {self.caption}", style="dim")

    def _column_widths(self, width: int) -> Optional[list[int]]:
        """Each column's cell width when they fit side by side in `width`, else None."""
        budget = width - (3 * len(self.names) + 1)  # rich's box: a border and a space either side, one edge
        natural = [max([len(n)] + [len(_cell(row[n])) for row in self.records]) for n in self.names]
        widths = [max(len(n), min(need, _MIN_CELL_WIDTH)) for n, need in zip(self.names, natural)]
        spare = budget - sum(widths)
        if spare < 0:
            return None
        # Share what is left among the columns whose cells are still cut, evenly.
        while spare > 0 and (cut := [i for i, w in enumerate(widths) if w < natural[i]]):
            for i in cut:
                grow = min(max(spare // len(cut), 1), natural[i] - widths[i], spare)
                widths[i] += grow
                spare -= grow
        return widths

    def _table(self, widths: list[int]) -> Table:
        table = Table(title=self.title)
        for name, width in zip(self.names, widths):
            table.add_column(name, width=width, no_wrap=True, overflow="ellipsis")
        for row in self.records:
            table.add_row(*(_cell(row[name], width) for name, width in zip(self.names, widths)))
        return table

    def _blocks(self, width: int) -> Group:
        name_width = max(map(len, self.names), default=0)
        value_width = max(width - name_width - 4, 1)  # "  name  value"
        lines = [Text(self.title, style="bold")]
        for index, row in enumerate(self.records):
            lines.append(Text(f"row {index}", style="bold"))
            lines += [
                Text(f"  {name:<{name_width}}  {_cell(row[name], value_width)}", no_wrap=True, overflow="ellipsis")
                for name in self.names
            ]
        return Group(*lines)


def stage_stats(fs, folder: str) -> dict[str, Any]:
    """Figures of one committed stage folder (plain numbers; `shards_stats` formats them).

    Keys: kind, rows, prompt_len / response_len {mean, max}, reward {mean, std, q10, q50, q90} (scored
    and experience only; std is the population std), policy_versions (sorted), finish_reasons {name: count}.
    """
    manifest = require_manifest(fs, folder)
    wanted = ["prompt_ids", "response_ids", "policy_version", "finish_reason"]
    if manifest.kind != "rollout":
        wanted.append("reward")
    tables = [read_part(fs, folder, p, manifest.kind).select(wanted) for p in manifest.parts]
    data = pa.concat_tables(tables)
    out: dict[str, Any] = {"kind": manifest.kind, "rows": data.num_rows}
    for name, column in (("prompt_len", "prompt_ids"), ("response_len", "response_ids")):
        lengths = pc.list_value_length(data.column(column))
        out[name] = {"mean": pc.mean(lengths).as_py(), "max": pc.max(lengths).as_py()}
    if "reward" in wanted:
        reward = data.column("reward")
        q = pc.quantile(reward, q=[0.1, 0.5, 0.9]).to_pylist() if data.num_rows else [None] * 3
        out["reward"] = {
            "mean": pc.mean(reward).as_py(),
            "std": pc.stddev(reward, ddof=0).as_py(),
            "q10": q[0],
            "q50": q[1],
            "q90": q[2],
        }
    out["policy_versions"] = sorted(pc.unique(data.column("policy_version")).to_pylist())
    counts = pc.value_counts(data.column("finish_reason")).to_pylist()
    out["finish_reasons"] = {c["values"]: c["counts"] for c in counts}
    return out


def _fmt(value: Optional[float], digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def shards_stats(uri: str, storage_cfg: Optional[StorageConfig] = None) -> FitTable:
    """One row per committed stage folder under `uri`: rows, lengths, reward, policy versions, finish reasons (a
    FitTable: every cell whole at any width, ppoflow/tables.py)."""
    fs, root, found = _stage_dirs_or_error(uri, storage_cfg)
    names = ("folder", "kind", "rows", "prompt len", "response len", "reward mean±std", "reward q10/50/90")
    columns = [(name, "left" if name in ("folder", "kind") else "right") for name in names]
    columns += [("versions", "right"), ("finish", "right")]
    rows = []
    for folder, manifest in found.items():
        if manifest is None:
            continue
        s = stage_stats(fs, folder)
        r = s.get("reward")
        rows.append(
            [
                _relative(folder, root),
                s["kind"],
                f"{s['rows']:,}",
                f"{_fmt(s['prompt_len']['mean'])}/{s['prompt_len']['max']}",
                f"{_fmt(s['response_len']['mean'])}/{s['response_len']['max']}",
                f"{_fmt(r['mean'])}±{_fmt(r['std'])}" if r else "-",
                "/".join(_fmt(r[k]) for k in ("q10", "q50", "q90")) if r else "-",
                ",".join(map(str, s["policy_versions"])) or "-",
                " ".join(f"{k}:{v}" for k, v in sorted(s["finish_reasons"].items())),
            ]
        )
    caption = "lengths in tokens as mean/max; reward std over samples; finish reasons as counts"
    return FitTable(f"shard statistics under {uri}", columns, rows, caption=caption)
