"""The arrows point down: import-linter's contracts in pyproject.toml (layers, no cycles, no torch in the
rule book and config) hold for every import statement, function-level ones included."""

import subprocess
import sys

from conftest import ROOT


def test_import_contracts_hold():
    proc = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()",
                           "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout and "3 kept" in proc.stdout
