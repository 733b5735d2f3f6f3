"""The arrows point down: import-linter's contracts in pyproject.toml (layers, parallel code free of the
trainer and `loom memory`, no torch in the rule book and config, no cycles) hold for every import
statement, function-level ones included."""

import shutil
import subprocess
import sys

from conftest import ROOT

CONTRACTS = 4


def lint_imports(root) -> subprocess.CompletedProcess:
    """`lint-imports` on the loom package under `root` (the package is found on the working directory)."""
    return subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()",
                           "--no-cache"], cwd=root, capture_output=True, text=True)


def test_import_contracts_hold():
    proc = lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert f"{CONTRACTS} kept, 0 broken" in proc.stdout, proc.stdout[-3000:]


def _append_in_function(path, statement):
    path.write_text(path.read_text() + f"\n\ndef _injected():\n    {statement}\n")


def test_each_contract_catches_its_violation(tmp_path):
    """The contracts are not vacuous: in a copy of loom, a function-level import of the trainer from
    parallel code, `import torch` in the rule book and config importing parallel code back (the cycle
    issue 11 removed) break every one of them."""
    shutil.copytree(ROOT / "loom", tmp_path / "loom", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    _append_in_function(tmp_path / "loom" / "parallel" / "tensor.py", "from loom.train import trainer")
    _append_in_function(tmp_path / "loom" / "rules.py", "import torch")
    _append_in_function(tmp_path / "loom" / "config" / "__init__.py", "from loom.parallel import dims")
    proc = lint_imports(tmp_path)
    assert proc.returncode != 0
    assert f"0 kept, {CONTRACTS} broken" in proc.stdout, proc.stdout[-3000:]
    for chain in ("loom.parallel.tensor -> loom.train", "loom.rules -> torch", "loom.config -> loom.parallel.dims"):
        assert chain in proc.stdout, (chain, proc.stdout[-5000:])
