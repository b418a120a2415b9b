"""What the results page's sections share (#14): the benchmarks' JSON lines read back, and Markdown tables of them.

bench/_page.py assembles docs/results.md; each benchmark that has a section draws it (its page_section) with these.
"""

import json
import os


def load(folder, name):
    """The records of docs/data/NAME.jsonl (none if it is not there)."""
    path = os.path.join(folder, f"{name}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as stream:
        return [json.loads(line) for line in stream if line.strip()]


def cell(value, digits=1, unit=""):
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.{digits}f}{unit}"
    return f"{value:,}{unit}" if isinstance(value, int) else str(value)


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def missing(what, command):
    return f"_Not measured yet: run `{command}` ({what})._"
