"""Shared fixtures: the repository root, the Caffe source sdist, the CLI runner."""

import hashlib
import importlib.util
import os
import subprocess
import sys
import tarfile

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
    done = subprocess.run([sys.executable, "-m", "deepspark.cli", *args], cwd=cwd, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": ROOT, **(env or {})}, timeout=600)
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
