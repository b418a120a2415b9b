"""Spark's own console progress bar, stopped where DeepSpark draws a job's progress in a notebook (deepspark/progress.py
draws it: a widget per worker, or plain lines): its `\\r` redraws of `[Stage 3:==> (1 + 1) / 2]` would glue onto them.
"""

from deepspark.progress import in_notebook


def no_spark_bar(session):
    """In a notebook, Spark's own console progress bar stopped for `session` (a classic SparkSession; nothing under
    Spark Connect). pyspark starts its JVM as a shell, which turns the bar on: it redraws `[Stage 3:==> (1 + 1) / 2]`
    with `\r` every 200 ms into the cell's stderr, where DeepSpark's lines then glue onto it; a cell shows the
    workers' progress instead (progress.display)."""
    sc = getattr(session, "_sc", None)
    if sc is None or not in_notebook():
        return
    bar = sc._jsc.sc().progressBar()  # Option[ConsoleProgressBar]: set where spark.ui.showConsoleProgress is
    if bar.isDefined():
        bar.get().stop()
