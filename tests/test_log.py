"""One way to log: every module's getLogger(__name__) is a child of `deepspark`, whose one handler, Log, writes each
record as a glog line to the console of the run it belongs to (above the progress line) and to its train.log."""

import io
import logging
import re
import threading

from deepspark import nets
from deepspark.config import load_solver
from deepspark.log import Log, train_log

from synthetic import make_job

GLOG = r"[IWE]\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ deepspark\] "


def test_a_modules_lines_go_to_the_runs_train_log_and_above_the_progress_line(tmp_path, capsys):
    console = io.StringIO()
    with Log(str(tmp_path / "train.log"), stream=console, progress=True) as log:
        log.progress("[=====>    ] 50/100")
        logging.getLogger("deepspark.data.convert").info("A total of %d items.", 3)
        logging.getLogger("deepspark.exchange.client").warning("worker %d: exchange connection lost (%s)", 1, "reset")
        logging.getLogger("deepspark.exchange.server").info("worker 1 joined")  # the job says that in its own words
        logging.getLogger("deepspark.data.feeder").error("bad record")
        logging.getLogger("deepspark.data.feeder").debug("Restarting data prefetching from start.")
    lines = (tmp_path / "train.log").read_text().splitlines()
    assert len(lines) == 3, lines
    assert re.fullmatch(r"I\d{4} [\d:.]+ \d+ deepspark\] A total of 3 items\.", lines[0])
    assert re.fullmatch(r"W\d{4} [\d:.]+ \d+ deepspark\] worker 1: exchange connection lost \(reset\)", lines[1])
    assert re.fullmatch(r"E\d{4} [\d:.]+ \d+ deepspark\] bad record", lines[2])
    # On the console: the bar cleared, the line, the bar drawn again; never the line glued onto the bar; once each.
    shown = console.getvalue()
    assert all(shown.count(line) == 1 for line in lines), shown
    assert "\r\033[K" + lines[1] + "\n[=====>    ] 50/100" in shown
    assert capsys.readouterr().err == ""  # nothing went around the Log to stderr


def test_without_a_runs_log_a_line_reaches_stderr_in_glog_form(capsys):
    """The process's console (an executor's worker process, a library call): stderr, in the same form."""
    logging.getLogger("deepspark.exchange.client").warning("worker 0: server refused non-finite parameters")
    logging.getLogger("deepspark.spark.executor").info("worker 0: GPU 0 from Spark")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2, err
    assert re.fullmatch(GLOG + "worker 0: server refused non-finite parameters", err[0]) and err[0][0] == "W"
    assert re.fullmatch(GLOG + "worker 0: GPU 0 from Spark", err[1]) and err[1][0] == "I"


def test_two_runs_at_once_each_keep_their_own_lines(tmp_path):
    """Fits in parallel (TrainValidationSplit's threads): each thread's records go to the Log it entered."""
    ready = threading.Barrier(2)

    def run(name):
        with Log(train_log(str(tmp_path / name)), stream=io.StringIO()):
            ready.wait()
            for i in range(20):
                logging.getLogger("deepspark.engine").info(f"{name} {i}")
            ready.wait()

    threads = [threading.Thread(target=run, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name in ("a", "b"):
        said = [line.split("] ", 1)[1] for line in (tmp_path / name / "train.log").read_text().splitlines()]
        assert said == [f"{name} {i}" for i in range(20)]


def test_an_exchange_servers_lines_go_to_the_log_of_the_run_that_started_it(tmp_path):
    """Its accept and connection threads carry the run's context: a refusal is said in its run's train.log, not
    in the newest open one (a second run in the process)."""
    import socket

    import numpy as np

    from deepspark.algorithms.easgd import EasgdHandler
    from deepspark.exchange import ExchangeServer

    with Log(train_log(str(tmp_path / "a")), stream=io.StringIO()):
        server = ExchangeServer(np.zeros(4, np.float32), b"secret", EasgdHandler(0.5), handshake_timeout=0.2).start()
        newer = Log(train_log(str(tmp_path / "b")), stream=io.StringIO())
        try:
            with socket.create_connection(server.address, timeout=10) as silent:  # refused: its handshake times out
                while silent.recv(4096):
                    pass
        finally:
            server.stop()
            newer.close()
    assert "refused" in (tmp_path / "a" / "train.log").read_text()
    assert "refused" not in (tmp_path / "b" / "train.log").read_text()


def test_a_single_runs_train_log_holds_its_modules_lines_as_its_console_shows_them(tmp_path, capsys):
    """`deepspark train --algorithm single` in this process: the engine's and the nets' lines, each a glog line,
    the same in train.log as on stderr; and once the run ends, its train.log takes no more."""
    solver = load_solver(make_job(tmp_path, max_iter=20, test_interval=20))
    result = nets.train(solver)
    logging.getLogger("deepspark.engine").warning("after the run")
    logged = open(train_log(result.output), encoding="utf-8").read().splitlines()
    err = [line for line in capsys.readouterr().err.splitlines() if re.match(GLOG, line)]
    assert all(re.match(GLOG, line) for line in logged), logged
    assert err[:len(logged)] == logged and re.fullmatch(GLOG + "after the run", err[-1])
    said = [line.split("] ", 1)[1] for line in logged]
    assert "Solving Tiny" in said and "Data order: as the source (Caffe's)" in said and "Optimization Done." in said
    assert any(line.startswith("    Test net output #0: accuracy = ") for line in said)
