"""Every third-party package the runtime imports is listed in ``requirements.txt``.

The main job's environment is built from ``requirements.txt`` alone, so a package that only
arrives through ``requirements-dev.txt`` (say, pulled in by ``torch``) would leave README
command 1 broken on a fresh machine while the test environment stays green.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_PACKAGES = ("runtime", "envs", "starpo_jax", "tdd_jax", "launch")
# Optional extras: imported only when the user selects them, refused with the install line when missing.
OPTIONAL = {"wandb": "trainer.logger=[console,wandb] (runtime.wandb_logger.require_loggers)"}


def canonical(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def required_distributions(path: Path) -> set[str]:
    """Distribution names listed in a requirements file (following ``-r`` includes)."""
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r"):
            names |= required_distributions(path.parent / line[2:].strip())
        elif line:
            names.add(canonical(re.match(r"[A-Za-z0-9_.\-]+", line).group(0)))
    return names


def imported_top_level_modules(package_dirs) -> dict[str, Path]:
    """Top-level names of absolute imports in every module (function-local imports included)."""
    found: dict[str, Path] = {}
    for package in package_dirs:
        for file in sorted(package.rglob("*.py")):
            for node in ast.walk(ast.parse(file.read_text(), filename=str(file))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name.split(".")[0], file)
    return found


def missing_requirements(package_dirs, requirements: set[str]) -> dict[str, tuple[str, Path]]:
    """``module -> (distribution, first importing file)`` for imports no listed distribution provides."""
    local = {path.name for path in ROOT.iterdir() if (path / "__init__.py").exists()}
    providers = importlib.metadata.packages_distributions()
    missing = {}
    for module, file in imported_top_level_modules(package_dirs).items():
        if module in sys.stdlib_module_names or module in local or module in OPTIONAL or module == "__future__":
            continue
        distributions = {canonical(d) for d in providers.get(module, [module])}
        if not distributions & requirements:
            missing[module] = (sorted(distributions)[0], file)
    return missing


def test_runtime_imports_are_in_requirements_txt():
    missing = missing_requirements([ROOT / p for p in RUNTIME_PACKAGES], required_distributions(ROOT / "requirements.txt"))
    assert not missing, "imported by the runtime but not in requirements.txt: " + ", ".join(
        f"{module} (distribution {dist}, imported in {file})" for module, (dist, file) in sorted(missing.items()))


def test_scan_finds_an_unlisted_import(tmp_path):
    """The check can fail: torch is installed (tests only) but not a runtime requirement."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "mod.py").write_text("import json\nimport numpy as np\n\ndef f():\n    from torch import nn\n")
    missing = missing_requirements([package], required_distributions(ROOT / "requirements.txt"))
    assert set(missing) == {"torch"}
    assert missing["torch"][0] == "torch"
