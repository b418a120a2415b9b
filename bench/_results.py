"""What every benchmark in bench/ shares: its results as JSON lines, printed and appended to a file.

A module of bench/ whose name starts with "_" is not a benchmark: `make bench` skips it.
"""

import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def results_path(name):
    """bench/results/NAME.jsonl, where a benchmark's lines go by default."""
    return os.path.join(ROOT, "bench", "results", f"{name}.jsonl")


def emit(record, out):
    """Print `record` as one JSON line, and append it to the file `out` (None or "": print only)."""
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "a") as stream:
            stream.write(line + "\n")
