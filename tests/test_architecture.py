"""The layout's rules: the layers contract (import-linter), nothing imports the CLI, every function-level import
of the library's own modules says what heavy dependency it defers, one way to log (no print but the CLI's, no log
handed around, train.log's path in one place), no class or function past its size; and the fast tier fails a
test that starts a JVM or imports pycaffe without its marker."""

import ast
import os
import re
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
    config = os.path.join(ROOT, ".importlinter")
    with open(config, encoding="utf-8") as stream:
        contracts = len(re.findall(r"^\[importlinter:contract:", stream.read(), re.M))
    done = subprocess.run([lint, config], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert contracts >= 3 and f"Contracts: {contracts} kept, 0 broken." in done.stdout, done.stdout[-4000:]


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


def calls_and_parameters(path):
    """(the names of the functions `path` calls by a bare name, the names of its functions' parameters, its string
    constants), from its syntax tree."""
    with open(path, encoding="utf-8") as stream:
        tree = ast.parse(stream.read())
    calls = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    parameters = {arg.arg for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for arg in node.args.args + node.args.kwonlyargs}
    strings = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    return calls, parameters, strings


def test_one_way_to_log():
    """No module but the CLI prints; none hands a log around (each logs with logging.getLogger(__name__), whose
    records deepspark.log.Log writes); the path of a run's train.log is made in deepspark/log.py alone."""
    prints, handed, named = [], [], []
    for path in library_files():
        where = os.path.relpath(path, ROOT)
        calls, parameters, strings = calls_and_parameters(path)
        if "print" in calls and where != os.path.join("deepspark", "cli.py"):
            prints.append(where)
        if "log" in parameters:
            handed.append(where)
        if "train.log" in strings and where != os.path.join("deepspark", "log.py"):
            named.append(where)
    assert not prints, f"print( outside deepspark/cli.py (log it, or return the text for the CLI): {prints}"
    assert not handed, f"a `log` parameter (log with logging.getLogger(__name__)): {handed}"
    assert not named, f"train.log's path made outside deepspark.log.train_log: {named}"


MAX_CLASS_LINES, MAX_FUNCTION_LINES = 250, 80


def oversized(path):
    """'PATH: class NAME (N lines)' / 'PATH: def NAME (N lines)' for each class over MAX_CLASS_LINES and each
    function (or method) over MAX_FUNCTION_LINES in a library file, from its syntax tree."""
    with open(path, encoding="utf-8") as stream:
        tree = ast.parse(stream.read())
    where = os.path.relpath(path, ROOT)
    for node in ast.walk(tree):
        lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
        if isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
            yield f"{where}: class {node.name}", lines
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > MAX_FUNCTION_LINES:
            yield f"{where}: def {node.name}", lines


def test_no_class_over_250_lines_and_no_function_over_80():
    found = dict(item for path in library_files() for item in oversized(path))
    assert len(list(library_files())) > 40  # the walk found the library
    assert not found, "split these: " + ", ".join(f"{name} ({lines} lines)" for name, lines in sorted(found.items()))


UNMARKED = """
import subprocess

import pytest


def test_starts_a_jvm_unmarked():
    subprocess.run(["java", "-version"], check=True)


def test_imports_pycaffe_unmarked():
    import caffe  # noqa: F401


@pytest.mark.spark
def test_marked():
    subprocess.run(["java", "-version"], check=True)
"""


def test_the_fast_tier_fails_a_test_that_starts_a_jvm_or_imports_pycaffe_without_its_marker(tmp_path):
    (tmp_path / "test_unmarked.py").write_text(UNMARKED)
    done = subprocess.run([sys.executable, "-m", "pytest", "--fast", "-p", "conftest", "-p", "no:cacheprovider", "-q",
                           "-W", "ignore::pytest.PytestUnknownMarkWarning", str(tmp_path / "test_unmarked.py")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "tests"), ROOT])})
    assert "2 failed, 1 deselected" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
    assert "needs @pytest.mark.spark" in done.stdout and "needs @pytest.mark.caffe" in done.stdout, done.stdout[-3000:]
