"""One logging system: the standard-library loggers of the exchanger and the data feeder write into the job's Log,
its train.log and its console, above the progress line."""

import io
import logging
import re

from deepspark import log as logs
from deepspark.log import Log


def test_a_library_warning_goes_to_train_log_and_above_the_progress_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(logs._FORWARD, "logs", [])  # a job's Log that an earlier test left open is not this one
    console = io.StringIO()
    log = Log(str(tmp_path / "train.log"), stream=console, progress=True)
    log.progress("[=====>    ] 50/100")
    logging.getLogger("deepspark.exchange.client").warning("worker %d: exchange connection lost (%s)", 1, "reset")
    logging.getLogger("deepspark.exchange.server").info("worker 1 joined")  # the job says that in its own words
    logging.getLogger("deepspark.data.feeder").error("bad record")
    log.close()
    lines = (tmp_path / "train.log").read_text().splitlines()
    assert len(lines) == 2, lines
    assert re.fullmatch(r"W\d{4} [\d:.]+ \d+ deepspark\] worker 1: exchange connection lost \(reset\)", lines[0])
    assert re.fullmatch(r"E\d{4} [\d:.]+ \d+ deepspark\] bad record", lines[1])
    # On the console: the bar cleared, the line, the bar drawn again; never the line glued onto the bar.
    shown = console.getvalue()
    assert "\r\033[K" + lines[0] + "\n[=====>    ] 50/100" in shown
    assert capsys.readouterr().err == ""  # nothing went around the Log to stderr


def test_without_a_job_log_a_library_warning_still_reaches_stderr(capsys, monkeypatch):
    monkeypatch.setattr(logs._FORWARD, "logs", [])
    logging.getLogger("deepspark.exchange.client").warning("worker 0: server refused non-finite parameters")
    assert capsys.readouterr().err == "worker 0: server refused non-finite parameters\n"
