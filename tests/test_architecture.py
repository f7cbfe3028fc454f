"""The module table of ARCHITECTURE.md as a test: what each package of ``controlplane`` must not import.

Every import counts, including the lazy ones inside functions and those under ``TYPE_CHECKING``: a module
that names another knows it. Data flows one way (cli → controller → placement/launchers/engines → state),
so a lower layer importing a higher one fails here with the file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "controlplane"

# package → the packages it knows nothing of (ARCHITECTURE.md, "knows nothing of").
FORBIDDEN: dict[str, set[str]] = {
    "fleet": {"placement", "engines", "launchers", "controller", "gateway", "state", "cli", "simulator"},
    "remote": {"fleet", "placement", "engines", "launchers", "controller", "gateway", "state", "cli"},
    "catalog": {
        "fleet",
        "remote",
        "placement",
        "engines",
        "launchers",
        "controller",
        "gateway",
        "state",
        "cli",
    },
    # Placement is pure: no transport, no state, no launching.
    "placement": {
        "fleet",
        "remote",
        "engines",
        "launchers",
        "controller",
        "gateway",
        "state",
        "cli",
        "weights",
    },
    "engines": {"fleet", "remote", "launchers", "controller", "gateway", "state", "cli", "placement"},
    "simulator": {
        "fleet",
        "remote",
        "catalog",
        "placement",
        "engines",
        "launchers",
        "weights",
        "state",
        "controller",
        "gateway",
        "observability",
        "cli",
    },
    "launchers": {"placement", "catalog", "controller", "gateway", "state", "cli", "simulator"},
    "weights": {"engines", "launchers", "placement", "controller", "gateway", "state", "cli"},
    "state": {
        "fleet",
        "remote",
        "catalog",
        "placement",
        "engines",
        "simulator",
        "launchers",
        "weights",
        "controller",
        "gateway",
        "observability",
        "cli",
    },
    "controller": {"gateway", "cli", "simulator"},
    "gateway": {"launchers", "remote", "controller", "placement", "cli", "simulator", "terraform"},
    "observability": {"gateway", "controller", "launchers", "cli"},
    "terraform": {"cli", "controller", "gateway", "launchers", "state"},
    # Bundles know what a site needs (catalog, fleet, weights) and how to reach nodes (remote), never serving.
    "bundle": {"placement", "engines", "launchers", "controller", "gateway", "state", "cli", "simulator"},
    "cli": set(),  # the top layer: the only place that prints, and nothing imports it
}

# The launch description is the contract between engines and launchers: launchers may name it, and
# nothing else of an engine.
ALLOWED: dict[str, set[str]] = {"launchers": {"controlplane.engines.base"}}

# Modules a pure package must not use (I/O of any kind).
IO_MODULES = {"subprocess", "socket", "httpx", "aiohttp", "redis", "fabric", "paramiko", "sqlite3", "urllib"}
PURE = {"placement", "catalog"}


def _imports(path: Path) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            # `from controlplane import gateway` names a package through its attribute.
            if node.module == "controlplane":
                found += [(node.lineno, f"controlplane.{alias.name}") for alias in node.names]
    return found


def _package_of(path: Path) -> str:
    return path.relative_to(PACKAGE).with_suffix("").parts[0]


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_package_has_a_rule() -> None:
    packages = {_package_of(p) for p in _modules()} - {"__init__", "errors", "spec", "settings", "_files"}
    assert packages - set(FORBIDDEN) == set(), "add the new package's row to FORBIDDEN (and ARCHITECTURE.md)"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_knows_nothing_of_what_it_must_not(path: Path) -> None:
    package = _package_of(path)
    forbidden = FORBIDDEN.get(package, set())
    allowed = ALLOWED.get(package, set())
    wrong = []
    for line, module in _imports(path):
        parts = module.split(".")
        named = parts[0] == "controlplane" and len(parts) > 1 and parts[1] in forbidden
        if named and not any(module == a or module.startswith(a + ".") for a in allowed):
            wrong.append(f"{path.name}:{line} imports {module}")
        if package in PURE and parts[0] in IO_MODULES:
            wrong.append(f"{path.name}:{line} imports {module} (I/O in a pure package)")
    assert not wrong, f"{package} must know nothing of {sorted(forbidden)}: " + "; ".join(wrong)


def test_the_rule_catches_an_upward_import(tmp_path: Path) -> None:
    """The checker itself: an upward import in a lower layer is found."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from controlplane.cli import ui\n    import subprocess\n")
    assert [m for _, m in _imports(bad)] == ["controlplane.cli", "subprocess"]
