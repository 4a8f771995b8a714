"""The house rules of ARCHITECTURE.md that a machine can check: no module outside the tests (conveyor,
the reference project's tasks and flows, the benchmarks) over 400 lines, no cycle among the imports
a module makes as it loads, and the CLI as the outermost door (only the CLI imports the CLI, lazily
or not), and nothing read of the process (directory, terminal, time) as a module loads, which a warm
runner's child would inherit."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "conveyor"
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if "template" in path.relative_to(PACKAGE).parts:  # conveyor init's project, not conveyor's code
            continue
        name = ".".join(path.with_suffix("").relative_to(SRC).parts).removesuffix(".__init__")
        found[name] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path], *, at_load: bool) -> Iterator[str]:
    """The conveyor modules ``name`` imports: at load only (module level, not under TYPE_CHECKING),
    or anywhere (functions' lazy imports too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nodes = tree.body if at_load else list(ast.walk(tree))
    for node in nodes:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                parts = package.split(".")
                base = ".".join([*parts[:len(parts) - node.level + 1], *([base] if base else [])])
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        yield from (t for t in targets if t in modules and t != name)


def test_no_module_outside_the_tests_is_over_400_lines() -> None:
    root = SRC.parent
    theirs = (p for folder in ("tasks", "flows", "benchmarks") for p in (root / folder).rglob("*.py"))
    paths = [*_modules().values(), *theirs]
    long = {str(path.relative_to(root)): n for path in paths
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}, f"split these by job (ARCHITECTURE.md): {long}"


def test_modules_import_one_another_without_a_cycle_as_they_load() -> None:
    modules = _modules()
    graph = {name: set(_imports(name, path, modules, at_load=True)) for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_only_the_cli_imports_the_cli() -> None:
    modules = _modules()
    offenders = {name for name, path in modules.items() if not name.startswith("conveyor.cli")
                 and any(t.startswith("conveyor.cli") for t in _imports(name, path, modules, at_load=False))}
    assert offenders == set(), "a door never imports from the CLI (ARCHITECTURE.md)"


# What a module may read of its process as it loads (module and class level, defaults of
# functions): a warm runner's child keeps the modules the runner imported in another directory,
# with its output on /dev/null and other terminal variables (conveyor.cli.warm_child). Allowed:
# the consoles, which the child renews (conveyor.cli.common.consoles_here); the CPU count and a
# kernel feature, the same on one machine.
_READS_THE_PROCESS = frozenset({"environ", "getenv", "cwd", "getpid", "stdout", "stderr", "isatty", "Console",
                                "get_terminal_size", "now", "time", "monotonic", "gethostname", "getuser", "home",
                                "cpu_count", "argv"})
_MAY_READ = {("conveyor.cli.common", "out"), ("conveyor.cli.common", "err"),
             ("conveyor.prefect.flow", "LOCAL_STAGES"), ("conveyor.run.guard", "_CHILDREN_LISTED")}


def _loading_statements(body: list[ast.stmt]) -> Iterator[ast.stmt | ast.expr]:
    """What runs as a module loads: its statements and class bodies, its functions' defaults and
    decorators, not their bodies, nor a ``__main__`` block."""
    for node in body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from [*node.args.defaults, *[d for d in node.args.kw_defaults if d], *node.decorator_list]
        elif isinstance(node, ast.ClassDef):
            yield from node.decorator_list
            yield from _loading_statements(node.body)
        elif not isinstance(node, (ast.Import, ast.ImportFrom, ast.Pass)):
            yield node


def _run_now(node: ast.AST) -> Iterator[ast.AST]:
    """``ast.walk`` but for what runs later: a lambda, a ``default_factory``."""
    yield node
    for child in ast.iter_child_nodes(node):
        later = isinstance(child, ast.Lambda) or (isinstance(child, ast.keyword) and child.arg == "default_factory")
        if not later:
            yield from _run_now(child)


def test_no_module_reads_its_process_as_it_loads_but_the_consoles_a_warm_child_renews() -> None:
    found = []
    for name, path in sorted(_modules().items()):
        for node in _loading_statements(ast.parse(path.read_text(encoding="utf-8")).body):
            nodes = list(_run_now(node))
            read = {n.id if isinstance(n, ast.Name) else n.attr for n in nodes
                    if isinstance(n, ast.Name | ast.Attribute)}
            targets = {t.id for t in getattr(node, "targets", [getattr(node, "target", None)])
                       if isinstance(t, ast.Name)}
            if (any(isinstance(n, ast.Call) for n in nodes) and read & _READS_THE_PROCESS
                    and not {(name, t) for t in targets} & _MAY_READ):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}: {sorted(read & _READS_THE_PROCESS)}")
    assert not found, "read as the module loads (a warm runner's child keeps the runner's):\n" + "\n".join(found)
