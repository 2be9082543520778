"""The import graph of the production packages has floors and no circles (issue 36 part 4).

Floors, lowest first; a module may import its own floor and the floors below it, never one above:

    ppoflow       the typed config: imports no other package of ours
    adaptations   upstream adaptations (Prefect, DeepSpeed, vLLM): imports no other package of ours either,
                  so an entry point on any floor can install them
    storage       shards, manifests, checkpoints on fsspec
    engines       the compute: models, samplers, rewards, the trainer; may import storage
    stages        the stage bodies (one function per stage, typed manifests in and out) and the bare loop that
                  calls them: what a task, a pool worker and the in-process pipeline run
    tasks         Prefect tasks
    runtime       where and how a stage runs (in-process, warm workers, the update group, pools): imports tasks
    flows         Prefect flows
    cli           the `ppoflow` command

The graph is read from the source with `ast`, nothing imported: every `import` and `from ... import`, at
module level or inside a function (a lazy import is still a dependency), resolved to the longest module path
that exists in the tree (`from engines.rewards import model` is an edge to engines.rewards.model). A failure
lists each offending edge as `importer -> imported (file:line)`.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FLOORS = ("ppoflow", "adaptations", "storage", "engines", "stages", "tasks", "runtime", "flows", "cli")
# ppoflow and adaptations are both ground floors: neither imports the other.
LEVEL = {
    "ppoflow": 0,
    "adaptations": 0,
    "storage": 1,
    "engines": 2,
    "stages": 3,
    "tasks": 4,
    "runtime": 5,
    "flows": 6,
    "cli": 7,
}

Edge = tuple[str, str, str]  # (importer, imported, "file:line")


def module_files(repo: Path = REPO) -> dict[str, Path]:
    """{dotted module name: file} for every .py file of the production packages (a package is its __init__)."""
    modules = {}
    for package in FLOORS:
        for path in sorted((repo / package).rglob("*.py")):
            parts = path.relative_to(repo).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imported_names(node: ast.AST, importer: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: from the importer's package, one level up per extra dot
        package = importer.split(".") if is_package else importer.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def import_edges(modules: dict[str, Path], repo: Path = REPO) -> set[Edge]:
    """Every import of one production module by another, resolved to the longest existing module path."""
    edges = set()
    for importer, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            for name in _imported_names(node, importer, path.name == "__init__.py"):
                parts = name.split(".")
                while parts and ".".join(parts) not in modules:
                    parts.pop()
                target = ".".join(parts)
                if target and target != importer:
                    edges.add((importer, target, f"{path.relative_to(repo)}:{node.lineno}"))
    return edges


def upward_edges(edges: set[Edge]) -> list[Edge]:
    """Edges into a higher floor, or between the two ground floors."""
    bad = []
    for importer, imported, where in edges:
        a, b = importer.split(".")[0], imported.split(".")[0]
        if a != b and LEVEL[b] >= LEVEL[a]:
            bad.append((importer, imported, where))
    return sorted(bad)


def cycles(edges: set[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted; [] when acyclic."""
    graph: dict[str, set[str]] = {}
    for importer, imported, _ in edges:
        graph.setdefault(importer, set()).add(imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _lines(edges) -> str:
    return "\n".join(f"  {a} -> {b} ({where})" for a, b, where in edges)


def test_no_import_points_up_a_floor():
    bad = upward_edges(import_edges(module_files()))
    assert not bad, "imports that point up a floor (see this file's docstring):\n" + _lines(bad)


def test_no_import_circles():
    edges = import_edges(module_files())
    found = cycles(edges)
    in_circles = [e for e in sorted(edges) if any(e[0] in c and e[1] in c for c in found)]
    assert not found, f"{len(found)} import circle(s) {found}; their edges:\n" + _lines(in_circles)


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return module_files(tmp_path)


def test_the_checks_find_an_upward_lazy_import_and_a_circle(tmp_path):
    # A tree built by hand: ppoflow.config imports engines inside a function (up), engines.a and engines.b import
    # each other (one of them relatively), tasks.t imports engines (down: allowed).
    modules = _tree(
        tmp_path,
        {
            "ppoflow/__init__.py": "",
            "ppoflow/config.py": "def f():\n    from engines.a import x\n",
            "engines/__init__.py": "",
            "engines/a.py": "from engines import b\n",
            "engines/b.py": "from .a import x\n",
            "tasks/__init__.py": "",
            "tasks/t.py": "import engines.b\n",
        },
    )
    edges = import_edges(modules, tmp_path)
    assert upward_edges(edges) == [("ppoflow.config", "engines.a", "ppoflow/config.py:2")]
    assert cycles(edges) == [["engines.a", "engines.b"]]
    assert ("tasks.t", "engines.b", "tasks/t.py:1") in edges


def test_the_graph_reads_the_real_tree():
    # a guard against a test that passes because it read nothing: known edges of the real tree are found
    edges = {(a, b) for a, b, _ in import_edges(module_files())}
    assert ("stages.update", "stages.update_trainer") in edges
    assert ("flows.preflight", "flows.preflight_static") in edges
    assert ("runtime.stage_runs", "tasks.stage_tasks") in edges
    assert len(edges) > 300


def test_no_flow_file_shadows_a_package():
    # Prefect loads a deployment's entrypoint (flows/training.py:ppo_training) as a script, with flows/ first on
    # sys.path: a flows/stages.py there made `import stages` (the stage bodies) find that file instead, and every
    # flow run on a work pool crashed before it started. The same holds for each folder holding an entrypoint.
    import yaml

    entry_dirs = {
        e["entrypoint"].split(":")[0].rsplit("/", 1)[0]
        for e in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    }
    packages = set(FLOORS)
    shadows = [f"{d}/{p.stem}.py" for d in sorted(entry_dirs) for p in (REPO / d).glob("*.py") if p.stem in packages]
    assert entry_dirs and not shadows, f"these files shadow a package when Prefect runs a flow: {shadows}"
