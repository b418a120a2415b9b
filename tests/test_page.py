"""bench/_page.py: docs/results.md from the page's benchmark records; a section without data says so."""

import importlib.util
import json
import os
import sys

from conftest import ROOT

_spec = importlib.util.spec_from_file_location("bench_page", os.path.join(ROOT, "bench", "_page.py"))
page = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(page)


def test_the_page_tables_each_record_plots_the_runs_and_says_what_is_missing(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    runs = [{"bench": "time_to_accuracy", "run": "easgd period 10", "tests": "off the clock",
             "points": [[20.5, 15040, 0.83], [31.0, 30080, 0.871], [40.2, 45120, 0.884]], "peak_pss_mb": 1890,
             "seconds_to_0.85": 31.0, "samples_to_0.85": 30080, "seconds_to_0.88": 40.2, "samples_to_0.88": 45120,
             "accuracy_at_180s": 0.884, "final_accuracy": 0.884},
            {"bench": "time_to_accuracy", "run": "elephas synchronous batch", "error": "no such mode"}]
    (data / "time_to_accuracy.jsonl").write_text("\n".join(map(json.dumps, runs)) + "\n")
    out = tmp_path / "docs" / "results.md"
    monkeypatch.setattr(sys, "argv", ["_page.py", "--data", str(data), "--out", str(out)])
    page.main()
    text = out.read_text()
    assert "| easgd period 10 | 31.0 s | 40.2 s | 30,080 | 45,120 | 0.8840 | 0.8840 | 1,890 MB |" in text
    assert "| elephas synchronous batch | could not run: no such mode |" in text
    assert (tmp_path / "docs" / "time_to_accuracy.png").stat().st_size > 10_000
    assert text.count("_Not measured yet") == 2  # the planner's and the network's sections
