"""bench/chaos.py's figures: each harmed run's ratio to its clean run, and the straggler's bound drawn from a lone
worker's run, on the page apart from the table."""

import argparse

from conftest import load_script

bench = load_script("bench/chaos.py", "bench_chaos")


def record(name, points, workers=2, iterations=4000):
    return {"bench": "chaos", "algorithm": "easgd", "run": name, "iterations": iterations, "workers": workers,
            "master": "spark://127.0.0.1:1", "returncode": 0, "points": points, "final_accuracy": points[-1][2],
            "load_average": [1.0, 2.0]}


CLEAN = record("clean", [[10.0, 0, 0.1], [40.0, 2000, 0.88], [60.0, 4000, 0.895]])
STRAGGLER = record("straggler at 0.33", [[8.0, 0, 0.1], [70.0, 2500, 0.89], [80.0, 3000, 0.896]])
# Alone, one worker reaches 0.895 at 90 s, 80 s after its first test at 10 s.
LONE = record(bench.LONE, [[10.0, 0, 0.1], [70.0, 3000, 0.8901], [90.0, 4000, 0.8951], [100.0, 6000, 0.9]],
              workers=1, iterations=6000)


def test_the_straggler_bound_counts_the_lone_workers_start_up_whole_and_its_training_at_the_jobs_rate():
    found = bench.figures([CLEAN, STRAGGLER, LONE], 0.005, 1 / 3)
    harmed, least = found
    assert harmed["figure"] == "straggler at 0.33" and harmed["ratio"] == round(80.0 / 60.0, 3)
    assert not harmed["meets_target"]
    # 10 s of start-up, then the lone worker's 80 s of training at (1 + 1/3)x its rate: 60 s; 70 / 60 s.
    assert least["figure"] == "straggler's bound" and least["lone_seconds"] == 90.0 and least["seconds"] == 70.0
    assert least["ratio"] == round(70.0 / 60.0, 3)
    # Less the tolerance (0.89): the clean run reached it at 60 s, the lone worker at 70 s: 10 + 60 x 0.75 = 55 s.
    assert least["seconds_within"] == 55.0 and least["ratio_within"] == round(55.0 / 60.0, 3)


def test_the_straggler_runs_under_another_rule_are_the_defaults_comparisons_with_no_target_of_their_own():
    others = [record(f"straggler at 0.33, {rule}", STRAGGLER["points"]) for rule in (bench.UNWEIGHTED, bench.UNPUSHED)]
    found = bench.figures([CLEAN, STRAGGLER, *others], 0.005, 1 / 3)
    assert [(f["target"], f["meets_target"]) for f in found] == [(1.2, False), (None, None), (None, None)]
    text = bench.page_section([CLEAN, STRAGGLER, *others, *found])
    assert "rate weighting alone turns that off (--straggler-share 0), the paper's rule rate weighting too" in text
    assert "turns that off" not in bench.page_section([CLEAN, STRAGGLER, *found[:1]])


def test_a_lone_worker_that_never_reaches_the_accuracy_gives_no_bound_and_the_page_says_so():
    short = dict(LONE, points=[[10.0, 0, 0.1], [100.0, 6000, 0.89]])
    harmed, least = bench.figures([CLEAN, STRAGGLER, short], 0.005, 1 / 3)
    assert least["seconds"] is None and least["ratio"] is None
    text = bench.page_section([CLEAN, STRAGGLER, short, harmed, least])
    assert "one worker alone took more than its run to 0.8950" in text and "longer than the lone run shows" in text


def test_the_page_tables_the_harmed_runs_and_gives_the_bound_in_words():
    runs = [CLEAN, STRAGGLER, LONE]
    text = bench.page_section(runs + bench.figures(runs, 0.005, 1 / 3))
    rows = [line for line in text.splitlines() if line.startswith("| easgd")]
    assert len(rows) == 1 and "straggler at 0.33" in rows[0] and "80 s / 60 s = 1.33x" in rows[0]
    assert ("The bound on easgd's straggler: one worker alone took 90 s to 0.8950; were the straggler's samples "
            "worth the lone worker's (one worker's SGD, no averaging) at 1.33x its samples/s, the job would take 70 s,"
            " 1.17x the clean run's (0.92x to it less the tolerance): the least any exchange rule could reach with "
            "these cores, against the 1.2x target.") in text


def test_easgd_is_measured_beside_its_straggler_under_the_papers_rule_without_its_push_and_alone_and_sync_is_not():
    args = argparse.Namespace(every=15.0, share=1 / 3, smoke=False)
    easgd = bench.measured_runs(args, "easgd")
    assert [(name, harm) for name, harm, _ in easgd] == [
        ("kill every 15 s", "kill"), ("straggler at 0.33", "straggler"),
        ("straggler at 0.33, the paper's rule", "straggler"), ("straggler at 0.33, rate weighting alone", "straggler"),
        (bench.LONE, None)]
    assert [knobs for _, _, knobs in easgd[2:]] == [{"flags": ["--no-rate-weighted"]},
                                                    {"flags": ["--straggler-share", "0"]}, {"workers": 1}]
    assert [name for name, _, _ in bench.measured_runs(args, "sync")] == ["kill every 15 s", "straggler at 0.33"]
    args.smoke = True  # make bench-smoke: the two harms only
    assert len(bench.measured_runs(args, "easgd")) == 2


def worker_lines(*trained):
    """The driver's Worker lines of a run's log, (iterations, seconds trained) each."""
    return "\n".join(f"I1207 05:22:38.081342 11748 deepspark] Worker {w} on vm (in /tmp/x/{w}, deepspark from /d): "
                     f"{n} iterations, 889 exchanges, spilled 30000 records in 0.08s, trained {s}s, blocked on "
                     "exchange 2.99s, sent 1.54e+03 MB and received 1.53e+03 MB through the exchanger, peak RSS 270 "
                     "MB after the spill, 405 MB" for w, (n, s) in enumerate(trained))


def test_a_figure_says_what_its_time_is_made_of_samples_a_second_and_samples_each_against_the_clean_runs():
    trained = lambda text: [[int(w), int(n), float(s)] for w, n, s in bench.TRAINED.findall(text)]  # noqa: E731
    clean = dict(CLEAN, trained=trained(worker_lines((4000, 80.0), (4000, 80.0))))  # 100 iterations/s
    assert clean["trained"] == [[0, 4000, 80.0], [1, 4000, 80.0]]
    # 60 + 20 iterations/s; 0.895 first at the job's iteration 3000 of 2 workers, the clean's at 4000
    straggler = dict(STRAGGLER, trained=trained(worker_lines((6000, 100.0), (2000, 100.0))))
    (harmed,) = bench.figures([clean, straggler], 0.005)
    assert harmed["samples_per_second_ratio"] == 0.8 and harmed["samples_ratio"] == 0.75
    text = bench.page_section([clean, straggler, harmed])
    assert "easgd's straggler at 0.33, 0.80x the samples/s and 0.75x the samples." in text
    assert bench.samples_to({"points": CLEAN["points"]}, 0.5) is None  # an older record: no workers kept
    (unmeasured,) = bench.figures([CLEAN, STRAGGLER], 0.005)  # no Worker lines: nothing to say
    assert unmeasured["samples_per_second_ratio"] is None
    assert "each against the clean run's: not measured." in bench.page_section([CLEAN, STRAGGLER, unmeasured])


def test_rounds_pair_each_harmed_run_with_its_own_rounds_clean_run_and_the_page_shows_the_median_and_range():
    rounds = []
    for repeat, (clean_end, straggler_end) in enumerate([(60.0, 80.0), (50.0, 75.0), (60.0, 66.0)]):
        clean = dict(CLEAN, repeat=repeat, points=[[10.0, 0, 0.1], [clean_end, 4000, 0.895]])
        rounds += [clean, dict(STRAGGLER, repeat=repeat, points=[[8.0, 0, 0.1], [straggler_end, 3000, 0.896]])]
    found = bench.figures(rounds, 0.005)
    assert [(f["repeat"], f["ratio"]) for f in found] == [(0, 1.333), (1, 1.5), (2, 1.1)]
    rows = [line for line in bench.page_section(rounds + found).splitlines() if line.startswith("| easgd")]
    # the median round's (80 s / 60 s) cells, the range of the three beside
    assert len(rows) == 1 and "80 s / 60 s = 1.33x (median of 3: 1.10-1.50x)" in rows[0], rows
    never = dict(STRAGGLER, repeat=1, points=[[8.0, 0, 0.1], [75.0, 3000, 0.5]])
    found = bench.figures(rounds[:3] + [never] + rounds[4:], 0.005)
    row = next(line for line in bench.page_section(found).splitlines() if line.startswith("| easgd"))
    assert "1.33x (median of 3: 1.10-not reached)" in row, row
    dated = [dict(r, date="2026-12-07") for r in rounds[:2]] + [dict(CLEAN, algorithm="sync")]
    assert "The runs' dates: easgd, 2026-12-07; sync, undated (an earlier invocation)." in bench.page_section(
        dated + bench.figures(dated, 0.005))
