"""Benches that keep working (#44): every bench of `make bench-all` has its smoke run in `make bench-smoke`, and no bench reaches into a private field of ours."""

import ast
import glob
import os
import re
import subprocess

from conftest import ROOT

# What a bench may take with a leading underscore, and why:
# - pycaffe's own Net methods, which its Net.forward and backward call (time_layers times Caffe's loop by hand);
# - the exchange client's socket in exchange_load's reconnect loop, which ends a connection as a dying worker does
#   (the socket closed between frames, or reset half-way through a frame): fault injection no client API offers.
ALLOWED = {"_forward": None, "_backward": None, "_layer_names": None,
           "_sock": "exchange_load.py", "_conn": "exchange_load.py"}


def benches():
    """The benches: bench/*.py but bench/_*.py (helpers, as bench/_results.py says)."""
    return sorted(os.path.basename(path)[:-3] for path in glob.glob(os.path.join(ROOT, "bench", "[!_]*.py")))


def dry_run(target):
    """What `make -n TARGET` would run (nothing is run; the prerequisites' recipes are printed too)."""
    done = subprocess.run(["make", "-n", "--no-print-directory", target], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_bench_all_runs_every_bench():
    listed = re.search(r"for b in ([\w ]+); do", dry_run("bench-all"))
    assert listed, "bench-all's loop over the benches not found"
    assert listed.group(1).split() == benches()


def test_every_bench_has_its_smoke_run_writing_to_a_temporary_folder():
    recipe = dry_run("bench-smoke")
    assert re.search(r'out=\$\(mktemp -d ', recipe), "bench-smoke's JSON must go to a temporary folder"
    for name in benches():
        runs = re.findall(rf"\S*python bench/{name}\.py ([^|]*?)--out \$out/{name}\.jsonl", recipe)
        assert len(runs) == 1, f"bench/{name}.py has no smoke run in `make bench-smoke` (or more than one)"
        flags = runs[0].split()
        with open(os.path.join(ROOT, "bench", f"{name}.py")) as stream:
            source = stream.read()
        for flag in {"--out", *(f for f in flags if f.startswith("--"))}:
            assert f'"{flag}"' in source, f"bench/{name}.py has no {flag}, which its smoke run gives it"
        assert flags, f"bench/{name}.py's smoke run has no flag: it would run the whole bench"


def private_uses(path):
    """(line, name) of every attribute or import of ours with a leading underscore, but self's and cls's own."""
    with open(path) as stream:
        tree = ast.parse(stream.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append((node.lineno, node.attr))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("deepspark"):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("_")]
    return found


def test_no_bench_touches_private_fields():
    wrong = []
    for path in sorted(glob.glob(os.path.join(ROOT, "bench", "*.py"))):
        name = os.path.basename(path)
        wrong += [f"bench/{name}:{line}: {attr}" for line, attr in private_uses(path)
                  if attr not in ALLOWED or ALLOWED[attr] not in (None, name)]
    assert not wrong, "benches must use public APIs (a backend's insides change under them):\n" + "\n".join(wrong)


def test_the_private_field_check_can_fail(tmp_path):
    bench = tmp_path / "bench.py"
    bench.write_text("def f(model, self):\n    self._mine = model._dir\n    return model._net.params\n"
                     "from deepspark.backends.caffe.model import _hidden\n")
    assert sorted(attr for _, attr in private_uses(str(bench))) == ["_dir", "_hidden", "_net"]
