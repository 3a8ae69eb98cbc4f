"""The tree's layers stay honest: every import (module level or inside a function, TYPE_CHECKING too) goes
down the order below or stays in its own layer, no module imports itself back through others, the services
never import each other (the `cleave` command excepted: it runs them), and no service but the command
reaches the simulator. docs/architecture.md's map lists the same folders.

Read from the source with `ast`, nothing imported: a new back-edge fails here with the import that made it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {  # import name -> folder
    "cleave": ROOT / "libs" / "cleave",
    "cleave_ps": ROOT / "services" / "ps" / "cleave_ps",
    "cleave_scheduler": ROOT / "services" / "scheduler" / "cleave_scheduler",
    "cleave_worker": ROOT / "services" / "worker" / "cleave_worker",
    "cleave_monitor": ROOT / "services" / "monitor" / "cleave_monitor",
    "cleave_cli": ROOT / "services" / "cli" / "cleave_cli",
}
# libs/cleave from the bottom up: a module may import its own layer and those before it, never a later one
LAYERS = ("errors", "schemas", "codec", "compression", "bus", "auth", "runtime", "models", "plan", "gemm", "train",
          "methods", "api", "sim")
SERVICES = ("cleave_ps", "cleave_scheduler", "cleave_worker", "cleave_monitor")
COMMAND = "cleave_cli"  # runs every service: the only package that may import them
MAX_TOP_LEVEL = 15  # entries of libs/cleave
MAX_LINES = 450  # lines of any module of libs/ or services/


def modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [pkg, *path.relative_to(folder).with_suffix("").parts]
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = modules()


def _known(name: str) -> str | None:
    """The module of ours that an imported name lives in (a package's __init__ for a name it defines)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> Iterator[tuple[str, int]]:
    """(module of ours imported, line) for every import statement in `module`, wherever it stands."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
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
            target = _known(name)
            if target is not None and target != module:
                yield target, node.lineno


EDGES = {m: sorted(set(imports(m))) for m in MODULES}


def layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "cleave" or len(parts) < 2:
        return None
    return LAYERS.index(parts[1])


def test_every_folder_of_libs_is_a_layer() -> None:
    entries = [p.stem for p in PACKAGES["cleave"].iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()]
    assert set(entries) - {"__init__"} == set(LAYERS), "a new top-level module or folder of libs/cleave needs its place in LAYERS"
    assert len(entries) <= MAX_TOP_LEVEL


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer(m) is not None))
def test_libs_import_only_their_own_layer_or_those_below(module: str) -> None:
    up = [f"{target} (line {line})" for target, line in EDGES[module]
          if layer(target) is not None and layer(target) > layer(module)]
    assert not up, f"{module} is in layer {LAYERS[layer(module)]!r} and imports a later layer: {up}"
    services = [t for t, _ in EDGES[module] if not t.startswith("cleave.") and t != "cleave"]
    assert not services, f"{module} imports a service: {services}"


@pytest.mark.parametrize("service", SERVICES)
def test_services_never_import_each_other(service: str) -> None:
    for module in (m for m in MODULES if m.split(".")[0] == service):
        others = [t for t, _ in EDGES[module] if t.split(".")[0] not in (service, "cleave")]
        assert not others, f"{module} imports another service: {others}"


@pytest.mark.parametrize("service", SERVICES)
def test_no_service_reaches_the_simulator(service: str) -> None:
    """Followed through every import: the scheduler's prediction uses the dealer on virtual time
    (cleave.gemm.engine), never cleave.sim."""
    seen, todo, via = set(), [m for m in MODULES if m.split(".")[0] == service], {}
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        for t, _ in EDGES[m]:
            via.setdefault(t, m)
            todo.append(t)
    sim = sorted(m for m in seen if m == "cleave.sim" or m.startswith("cleave.sim."))
    assert not sim, f"{service} reaches {sim[0]} through {via[sim[0]]}"


def test_no_module_imports_itself_back() -> None:
    """No circle among modules. A module naming its own package's names (`from cleave.gemm.dealer import
    Send` inside cleave.gemm.dealer) is not an edge: the package is always initialised before its modules."""
    graph = {m: {t for t, _ in EDGES[m] if not (MODULES[t].name == "__init__.py" and m.startswith(t + "."))}
             for m in MODULES}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (found := visit(t)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (circle := visit(m)):
            pytest.fail("import circle: " + " -> ".join(circle))


def test_no_module_is_past_the_size_one_reads_whole() -> None:
    big = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"over {MAX_LINES} lines: {big}"


def test_the_architecture_map_lists_every_folder() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    folders = [f"libs/cleave/{name}" for name in LAYERS] + [
        f"{PACKAGES[p].relative_to(ROOT)}/{d.name}" for p in (*SERVICES, COMMAND) for d in PACKAGES[p].iterdir()
        if (d / "__init__.py").exists()]
    missing = [f for f in folders if f"`{f}" not in doc]
    assert not missing, f"docs/architecture.md's map does not list {missing}"


def test_every_exception_lives_in_the_error_tree() -> None:
    """One error tree: no module but cleave.errors defines an exception (a class deriving from Exception,
    BaseException or one of the tree's classes)."""
    tree = ast.parse(MODULES["cleave.errors"].read_text())
    errors = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    roots = {*errors, "Exception", "BaseException", "RuntimeError", "ValueError", "KeyError", "OSError"}
    stray = []
    for module, path in MODULES.items():
        if module == "cleave.errors":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases if isinstance(b, (ast.Name, ast.Attribute))}
                if bases & roots:
                    stray.append(f"{module}.{node.name}")
    assert not stray, f"exceptions outside cleave.errors: {stray}"


def test_one_class_per_name() -> None:
    """A name means one thing across libs and services (each model family's own Block and MLP excepted: a
    family is one self-contained file, as in nanoGPT)."""
    family = {"Block", "MLP"}
    where: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name not in family:
                where.setdefault(node.name, []).append(module)
    twice = {name: mods for name, mods in where.items() if len(mods) > 1}
    assert not twice, f"classes of the same name: {twice}"


def test_every_package_is_installed() -> None:
    """A non-editable install (the compose image, a wheel) ships only the packages pyproject.toml lists: every
    folder of ours with an __init__.py is there."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    ours = {".".join([pkg, *p.parent.relative_to(folder).parts]) for pkg, folder in PACKAGES.items()
            for p in folder.rglob("__init__.py")}
    assert ours - listed == set(), "packages missing from pyproject.toml's [tool.setuptools] packages"


@pytest.mark.parametrize("role", ["scheduler", "monitor", "chaos", "submit", "cancel", "forget", "status", "up"])
def test_the_light_roles_start_without_torch(role: str) -> None:
    """The scheduler, the monitor, `cleave chaos`, a hub's `cleave submit`, `cancel`, `forget` and `status`, and the
    supervisor of `cleave up` never touch a tensor: their command line and their whole service or command import
    without torch (2 s of CPU and 200 MB a process; the PS and the workers need it; `cleave submit --help` took
    2 s, 0.7 s now)."""
    import subprocess
    import sys

    code = ("import sys, importlib; from cleave_cli import main; main.build_parser(sys.argv[1]); "
            "importlib.import_module({'scheduler': 'cleave_scheduler.main', 'monitor': 'cleave_monitor.main', "
            "'submit': 'cleave_cli.jobs_cmd', 'cancel': 'cleave_cli.jobs_cmd', 'forget': 'cleave_cli.jobs_cmd', "
            "'status': 'cleave_cli.jobs_cmd', 'up': 'cleave_cli.up_cmd'}.get(sys.argv[1], 'cleave_cli.chaos_cmd')); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code, role], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout[:500]


def test_the_whole_command_line_is_built_without_torch() -> None:
    """`cleave --help`, `cleave train --help` and a mistyped option are answered without importing torch (2.4 s
    before, 0.7-1.0 s now): each command imports what it runs when it runs."""
    import subprocess
    import sys

    code = ("import sys; from cleave_cli import main; main.build_parser(); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout[:500]
