"""The layout's rules: the layers contract (import-linter), nothing imports the CLI, and every
function-level import of the library's own modules says what heavy dependency it defers."""

import ast
import os
import subprocess
import sys

from conftest import ROOT

PACKAGE = os.path.join(ROOT, "deepspark")
DEFERRABLE = ("pyspark", "TensorFlow", "pycaffe")


def library_files():
    for folder, _, names in os.walk(PACKAGE):
        if os.path.basename(folder) != "proto":
            yield from (os.path.join(folder, name) for name in names if name.endswith(".py"))


def test_the_layers_contract_holds():
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    done = subprocess.run([lint, "--config", os.path.join(ROOT, ".importlinter")], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken." in done.stdout


def test_nothing_in_the_library_imports_the_cli():
    for path in library_files():
        if path.endswith(os.path.join("deepspark", "cli.py")):
            continue
        with open(path, encoding="utf-8") as stream:
            assert "deepspark.cli" not in stream.read(), path


def own_imports_in_functions(tree):
    """(line, module) of every `import deepspark...` / `from deepspark... import` inside a function."""
    for function in ast.walk(tree):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("deepspark")):
                    yield node.lineno, node.module
                elif isinstance(node, ast.Import):
                    yield from ((node.lineno, a.name) for a in node.names if a.name.startswith("deepspark"))


def test_function_level_imports_of_our_modules_say_what_they_defer():
    found, unexplained = 0, []
    for path in library_files():
        with open(path, encoding="utf-8") as stream:
            source = stream.read()
        lines = source.splitlines()
        for line, module in own_imports_in_functions(ast.parse(source)):
            found += 1
            if not ("# deferred" in lines[line - 1] and any(d in lines[line - 1] for d in DEFERRABLE)):
                unexplained.append(f"{os.path.relpath(path, ROOT)}:{line}: {module}")
    assert not unexplained, "function-level imports without a '# deferred: ... pyspark/TensorFlow/pycaffe' reason:\n" \
        + "\n".join(unexplained)
    assert found >= 1  # deepspark.train defers deepspark.spark (pyspark): the check has something to check
