"""Shared fixtures: the repository root, the Caffe source sdist, the CLI runner; and the fast tier (--fast)."""

import ast
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.environ.get("DEEPSPARK_CACHE", os.path.expanduser("~/.cache/deepspark"))
SDIST = "brocolli-caffe-9.0.2.tar.gz"
SDIST_SHA256 = "c6410cc60bdd6db685d441b66be7df05410f8850ac88d6b75d48ef9b2315c08a"


def load_script(relative, name):
    """A script of the repository (bench/NAME.py, a module that is no package's) loaded as module `name`, its folder
    on sys.path first: where it finds its neighbours (bench/_results.py, ...), as when it runs."""
    path = os.path.join(ROOT, relative)
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_cli(*args, cwd=ROOT, env=None):
    """`deepspark ARGS` in a fresh process: (exit status, stdout, stderr)."""
    path = os.pathsep.join([GUARD["python"], ROOT] if GUARD else [ROOT])  # the fast tier's pycaffe stand-in first
    done = subprocess.run([sys.executable, "-m", "deepspark.cli", *args], cwd=cwd, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": path, **(env or {})}, timeout=600)
    return done.returncode, done.stdout, done.stderr


@pytest.fixture(scope="session")
def caffe_source():
    """The unpacked brocolli-caffe 9.0.2 sdist (official Caffe source), downloaded once and cached."""
    folder = os.path.join(CACHE, "sdist")
    tree = os.path.join(folder, "brocolli-caffe-9.0.2")
    if not os.path.isdir(tree):
        os.makedirs(folder, exist_ok=True)
        archive = os.path.join(folder, SDIST)
        if not os.path.exists(archive):
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                            "brocolli-caffe==9.0.2", "-d", folder], check=True)
        with open(archive, "rb") as stream:
            assert hashlib.sha256(stream.read()).hexdigest() == SDIST_SHA256
        partial = tree + f".tmp-{os.getpid()}"
        with tarfile.open(archive) as tar:
            tar.extractall(partial, filter="data")
        os.rename(os.path.join(partial, "brocolli-caffe-9.0.2"), tree)
        os.rmdir(partial)
    return tree


# -- the fast tier (`make test-fast`): every test that needs no JVM and no pycaffe ---------------------------------

FAST_TIER = "not spark and not caffe"
MODULE_MARKS = ("spark", "caffe")  # a module marked whole with one of these is not even imported in the fast tier
GUARD = {}  # the fast tier's stand-ins once installed: {"folder": ..., "python": folder for PYTHONPATH}
JAVA_STAND_IN = """#!/bin/sh
echo "deepspark's fast tier starts no JVM: a test that starts Spark (or any JVM) needs @pytest.mark.spark" >&2
exit 1
"""
NO_CAFFE = "deepspark's fast tier imports no pycaffe: a test that needs it needs @pytest.mark.caffe"


def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true",
                     help=f"the fast tier: only tests that are `{FAST_TIER}`; a JVM or pycaffe in one of them fails it")


class _NoCaffe:
    """A meta-path finder that refuses pycaffe in this process (the fast tier's stand-in for its absence)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "caffe" or name.startswith("caffe."):
            raise ImportError(NO_CAFFE)
        return None


def pytest_configure(config):
    """With --fast: select the fast tier, and put stand-ins where a JVM (JAVA_HOME and PATH's `java`, which
    Spark's launcher runs) and pycaffe (this process's imports, and run_cli's PYTHONPATH) would be found, so that a
    test without its marker that starts one fails instead of passing slowly."""
    if not config.getoption("--fast"):
        return
    config.option.markexpr = f"({config.option.markexpr}) and {FAST_TIER}" if config.option.markexpr else FAST_TIER
    folder = tempfile.mkdtemp(prefix="deepspark-fast-tier-")
    os.makedirs(os.path.join(folder, "bin"))
    java = os.path.join(folder, "bin", "java")
    with open(java, "w") as stream:
        stream.write(JAVA_STAND_IN)
    os.chmod(java, 0o755)
    os.makedirs(os.path.join(folder, "python", "caffe"))
    with open(os.path.join(folder, "python", "caffe", "__init__.py"), "w") as stream:
        stream.write(f"raise ImportError({NO_CAFFE!r})\n")
    os.environ["JAVA_HOME"] = folder
    os.environ["PATH"] = os.path.join(folder, "bin") + os.pathsep + os.environ.get("PATH", "")
    sys.meta_path.insert(0, _NoCaffe)
    GUARD.update(folder=folder, python=os.path.join(folder, "python"))


def pytest_unconfigure(config):
    if GUARD:
        shutil.rmtree(GUARD["folder"], ignore_errors=True)


def marked_whole(path):
    """The marks of a test module's own `pytestmark = pytest.mark.X` line, read without importing it."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return set()
    marks = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            marks.update(v.attr for v in values if isinstance(v, ast.Attribute))
    return marks


def pytest_ignore_collect(collection_path, config):
    """In the fast tier, a module marked whole spark or caffe is left unimported: its tests would all be
    deselected, and its imports (pycaffe at module level) are what the fast tier does without."""
    if GUARD and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return bool(marked_whole(collection_path) & set(MODULE_MARKS)) or None
    return None


def pytest_collection_modifyitems(config, items):
    """The modules with a test marked slow first, then those that start Spark, then the rest, each kind in file
    order. `make test` hands whole modules to its processes in this order (--no-loadscope-reorder), so that the
    long ones start early and the processes end close together, not one of them alone on a long module handed
    out last."""
    rank = {}
    for item in items:
        marks = {mark.name for mark in item.iter_markers()}
        module = item.nodeid.split("::")[0]
        rank[module] = min(rank.get(module, 2), 0 if "slow" in marks else 1 if "spark" in marks else 2)
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])
