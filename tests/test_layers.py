"""lmkv's import graph: no cycles, no upward imports, every module placed.

The layers are read from the table in docs/architecture.md, which places
packages (one per layer), so the page, the tree and this test cannot drift
apart. Every import counts: module level, inside
functions, under ``TYPE_CHECKING``, and the ``__init__`` of each package a
module imports from (Python runs it first).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"lmkv": ROOT, "lmkv_backends": ROOT, "lmkv_policies": ROOT,
            "lmkv_kernels": ROOT / "kernels"}
DOC = ROOT / "docs" / "architecture.md"


def _layers() -> dict[str, tuple[int, str]]:
    """``{module prefix: (layer number, layer name)}`` from the page's table."""
    table: dict[str, tuple[int, str]] = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"\|\s*(\d+) ([\w -]+?)\s*\|([^|]*)\|", line)
        if m:
            for name in re.findall(r"`([\w.]+)`", m.group(3)):
                table[name] = (int(m.group(1)), m.group(2))
    return table


def _modules(packages: dict[str, Path]) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, base in packages.items():
        if not (base / package).is_dir():
            continue
        for path in (base / package).rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules(PACKAGES)
LAYERS = _layers()
# Top-level packages whose __init__ only re-exports lazily (checked below by
# test_importing_a_module_runs_no_facade): importing one of their modules runs
# no import of theirs, so that implicit run is no edge.
LAZY_ROOTS = {"lmkv", "lmkv.config", "lmkv.contracts", "lmkv.storage", "lmkv_backends",
              "lmkv_policies"}


def _known(name: str, modules: dict[str, Path] = MODULES) -> str | None:
    """The deepest module of ours that ``name`` names or lies in, if any."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _with_parents(module: str) -> Iterator[str]:
    """``module`` and every package above it, whose ``__init__`` runs first."""
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        yield ".".join(parts[:i])


def _imports(module: str, modules: dict[str, Path] = MODULES) -> set[str]:
    """What running ``module`` imports of ``modules``: each module an import names
    (a package, when a name is taken from its ``__init__``), and the packages
    above it that Python runs first, less ``module``'s own packages (already
    running) and the lazy top-level packages."""
    path = modules[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    own = set(_with_parents(module))
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            target = _known(name, modules)
            if not target:
                continue
            targets.add(target)
            targets.update(p for p in list(_with_parents(target))[:-1]
                           if p not in own and p not in LAZY_ROOTS)
    targets.discard(module)
    return targets


GRAPH = {module: _imports(module) for module in MODULES}


def _layer(module: str) -> tuple[int, str] | None:
    for prefix in reversed(list(_with_parents(module))):
        if prefix in LAYERS and (prefix != "lmkv" or module == "lmkv"):
            return LAYERS[prefix]
    return None


def test_importing_a_module_runs_no_facade() -> None:
    """``import lmkv.base.errors`` loads lmkv's package __init__ (lazy re-exports,
    with the few base modules it needs) and the module itself, nothing else of
    lmkv; ``lmkv.contracts`` loads nothing until asked: that is why the graph may
    leave the lazy packages' __init__ out of every module's imports."""
    import subprocess
    import sys

    code = ("import sys, lmkv.base.errors, lmkv.contracts, lmkv_backends, lmkv_policies; "
            "print(sorted(m for m in sys.modules if m.startswith('lmkv')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == str(["lmkv", "lmkv.base", "lmkv.base.errors", "lmkv.base.exports",
                               "lmkv.base.moved", "lmkv.contracts", "lmkv_backends",
                               "lmkv_policies"])


def test_the_table_names_real_packages() -> None:
    assert LAYERS, f"no layer table found in {DOC}"
    missing = sorted(name for name in LAYERS if name not in MODULES)
    assert not missing, f"docs/architecture.md names packages that do not exist: {missing}"
    modules = sorted(name for name in LAYERS if MODULES[name].name != "__init__.py"
                     and name != "lmkv.__main__")
    assert not modules, f"docs/architecture.md places modules, not packages: {modules}"


def test_lmkv_has_no_loose_modules() -> None:
    """Each module of lmkv lives in the package of its layer; only the package's
    own ``__init__`` and ``__main__`` sit at the top."""
    loose = sorted(p.name for p in (ROOT / "lmkv").glob("*.py")
                   if p.name not in ("__init__.py", "__main__.py"))
    assert not loose, f"modules at lmkv's top level (move each into its layer's package): {loose}"


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(m for m in MODULES if _layer(m) is None)
    assert not unplaced, (f"modules with no layer (add them to the table in "
                          f"docs/architecture.md): {unplaced}")


def test_no_module_imports_a_higher_layer() -> None:
    upward = []
    for module, targets in GRAPH.items():
        mine = _layer(module)
        for target in targets:
            theirs = _layer(target)
            if mine and theirs and theirs[0] > mine[0]:
                upward.append(f"{module} ({mine[1]}) imports {target} ({theirs[1]})")
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))


def test_the_core_never_imports_a_plugin() -> None:
    plugins = ("lmkv_backends", "lmkv_policies", "lmkv_kernels", "lmkv_redis", "lmkv_mooncake")
    offenders = sorted(f"{m} imports {t}" for m, ts in GRAPH.items() for t in ts
                       if m.split(".")[0] == "lmkv" and not m.startswith("lmkv.testing")
                       and t.split(".")[0] in plugins)
    assert not offenders, "\n".join(offenders)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


PLUGINS = sorted(p.name for p in (ROOT / "plugins").iterdir()
                 if (p / p.name.replace("-", "_")).is_dir())
#: lmkv's own top-level packages and the plugins': what a plugin may not reach
#: into, beyond its own package and the two public roots.
FIRST_PARTY = {*PACKAGES, *(name.replace("-", "_") for name in PLUGINS)}
#: What everything under plugins/ may import of lmkv: the contracts (from their
#: root) and, from tests, lmkv.testing.
PLUGIN_ROOTS = ("lmkv.contracts",)
PLUGIN_TEST_ROOTS = ("lmkv.testing",)


def _names_imported(path: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every absolute import in ``path``, anywhere in it; a
    name taken from a package is ``package.name`` (``from lmkv import X``:
    ``lmkv.X``)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module in FIRST_PARTY:  # a bare package: what is taken from it counts
                for alias in node.names:
                    yield node.lineno, f"{node.module}.{alias.name}"
            else:
                yield node.lineno, node.module


def plugin_violations(directory: Path, package: str) -> list[str]:
    """Imports under ``directory`` (a plugin's package, tests and all) of lmkv or
    another plugin beyond ``lmkv.contracts`` (its root) and ``lmkv.testing``."""
    found = []
    for path in sorted(directory.rglob("*.py")):
        for line, name in sorted(_names_imported(path)):
            top = name.split(".")[0]
            if top not in FIRST_PARTY or top == package:
                continue  # third-party, the plugin's own package, or its tests' own modules
            if name in PLUGIN_ROOTS or any(name == root or name.startswith(root + ".")
                                           for root in PLUGIN_TEST_ROOTS):
                continue
            found.append(f"{path.relative_to(directory)}:{line} imports {name}")
    return found


def test_every_plugin_is_checked() -> None:
    assert {"lmkv-mooncake", "lmkv-redis"} <= set(PLUGINS), PLUGINS


@pytest.mark.parametrize("plugin", PLUGINS)
def test_plugin_packages_have_no_cycles(plugin: str) -> None:
    package = plugin.replace("-", "_")
    modules = _modules({package: ROOT / "plugins" / plugin})
    graph = {m: _imports(m, modules) for m in modules}
    assert not _cycles(graph), _cycles(graph)


@pytest.mark.parametrize("plugin", PLUGINS)
def test_plugins_import_lmkv_only_through_contracts_and_testing(plugin: str) -> None:
    """Everything under plugins/ (each package and its tests) imports its own
    package, lmkv.contracts, lmkv.testing and third-party libraries only."""
    violations = plugin_violations(ROOT / "plugins" / plugin, plugin.replace("-", "_"))
    assert not violations, ("import from lmkv.contracts (plugin code) or lmkv.testing "
                            "(tests) instead:\n" + "\n".join(violations))


def test_the_plugin_rule_finds_what_it_forbids(tmp_path: Path) -> None:
    sources = {
        "hello/__init__.py": "from lmkv.contracts import StorageBackend\nimport redis\n",
        "hello/bad.py": ("from lmkv import KVSpec\nimport lmkv.memory\n"
                         "from lmkv.contracts.faults import TierFaults\n"
                         "def f():\n    from lmkv_backends.serde.naive import NaiveSerializer\n"
                         "from lmkv_redis import RedisBackend\n"),
        "hello/fine.py": ("from . import bad\nfrom hello.bad import f\nimport lmkv.contracts\n"
                          "from lmkv import contracts\n"),
        "tests/conftest.py": ("from lmkv.testing.redis import RedisServer\n"
                              "from hello_helpers import x\nfrom lmkv.storage import manager\n"),
    }
    for name, text in sources.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert plugin_violations(tmp_path, "hello") == [
        "hello/bad.py:1 imports lmkv.KVSpec", "hello/bad.py:2 imports lmkv.memory",
        "hello/bad.py:3 imports lmkv.contracts.faults",
        "hello/bad.py:5 imports lmkv_backends.serde.naive",
        "hello/bad.py:6 imports lmkv_redis.RedisBackend",
        "tests/conftest.py:3 imports lmkv.storage"]


def test_the_graph_sees_what_python_would_trip_on(tmp_path: Path) -> None:
    """A name taken from one's own package's __init__ while that __init__ imports
    the module is a cycle (``cannot import name ... partially initialized``);
    relative imports at any depth resolve."""
    sources = {"p/__init__.py": "from p.a import A\n", "p/a.py": "from p import B\n",
               "p/b.py": "from . import a\n", "p/sub/__init__.py": "",
               "p/sub/c.py": "from ..b import X\nfrom .. import a\n"}
    for name, text in sources.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    modules = _modules({"p": tmp_path})
    graph = {m: _imports(m, modules) for m in modules}
    assert graph["p.a"] == {"p"} and graph["p"] == {"p.a"}
    assert _cycles(graph) == [["p", "p.a"]]
    assert graph["p.b"] == {"p.a"}
    assert graph["p.sub.c"] == {"p.b", "p.a"}
