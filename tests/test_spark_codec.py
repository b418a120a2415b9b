"""exchange_codec on real Spark: 2 workers on local[2] train through int8 frames, a quarter of float32's bytes, to
float32's accuracy; a codec that codes nothing is refused in one line."""

import re

import pytest

from conftest import run_cli
from sparkjobs import final_accuracy, workers_done
from synthetic import make_job

SENT = re.compile(r"Worker (\d+) on .*?: (\d+) iterations, (\d+) exchanges, .*?sent ([\d.e+-]+) MB and received "
                  r"([\d.e+-]+) MB through the exchanger")


def train(tmp_path, *flags):
    tmp_path.mkdir()
    solver = make_job(tmp_path, max_iter=120, test_interval=120, snapshot=0)
    net = tmp_path / "net.prototxt"  # 64 filters, not 4: ~1,800 parameters, so that frames outweigh their headers
    net.write_text(net.read_text().replace("num_output: 4 kernel_size: 3", "num_output: 64 kernel_size: 3"))
    status, _, log = run_cli("train", "--solver", solver, "--workers", "2", "--period", "4", *flags)
    assert status == 0, log[-3000:]
    assert workers_done(log) == [0, 1]
    rows = SENT.findall(log)
    assert len(rows) == 2, log[-3000:]
    # MB a worker sends per exchange (its pull of the center and its history are a few frames beside them)
    return final_accuracy(log), sum(float(sent) / int(exchanges) for _, _, exchanges, sent, _ in rows) / 2


@pytest.mark.spark
def test_int8_workers_send_a_quarter_and_learn_as_much(tmp_path):
    plain_accuracy, plain_sent = train(tmp_path / "float32")
    accuracy, sent = train(tmp_path / "int8", "--exchange-codec", "int8")
    assert plain_sent / sent >= 3.0, (plain_sent, sent)  # 3.9x the payloads; headers, tags and reports as they were
    assert accuracy >= 0.9 and accuracy >= plain_accuracy - 0.05, (accuracy, plain_accuracy)


def test_a_codec_with_average_is_refused_in_one_line(tmp_path):
    solver = make_job(tmp_path, max_iter=20)
    status, _, err = run_cli("train", "--solver", solver, "--algorithm", "average", "--exchange-codec", "int8")
    assert status != 0 and err.strip().count("\n") == 0, err
    assert "exchange_codec INT8 codes the exchanger's frames (easgd, sync); average moves its models through Spark" \
        in err
