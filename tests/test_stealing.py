"""Work stealing of record blocks (#45, stragglers): the job's ledger on the exchanger grants every block of every
worker's record range once a job epoch, a worker's own first and then the range most behind from its back; workers
claim them through a CLAIM frame and their Data feeders read them; a straggler's unread records are read by the
others. The ledger and the frames alone, a real exchanger with its client, real LMDBs, and a real Spark job."""

import os
import re
import time

import numpy as np
import pytest
from google.protobuf import text_format

from deepspark.algorithms import Easgd
from deepspark.algorithms.easgd import EasgdHandler
from deepspark.algorithms.sync import Sync
from deepspark.config import load_solver
from deepspark.data import encode_datum
from deepspark.data.lmdb_io import read_records, write_lmdb
from deepspark.data.sources import write_records
from deepspark.data.feeder import DataFeeder
from deepspark.exchange import ExchangeClient, ExchangeServer
from deepspark.exchange import protocol as P
from deepspark.exchange.ledger import Ledger
from deepspark.proto import deepspark_pb2 as pb
from deepspark.spark.shards import stealing
from sparkjobs import train_with_straggler, workers_done
from synthetic import make_job
from test_data_order import RECORDED_NET, RECORDED_SOLVER, RECORDER

SECRET = b"per-job-secret"
RANGES = [(0, 200), (200, 400)]  # two workers' record ranges: 4 blocks of 64 records each (the last 8)


def blocks_of(grants):
    return sorted((g.first, g.count) for g in grants)


def everyone(block=64):
    """Every block of RANGES as (first, count)."""
    return sorted((first, min(block, stop - first)) for start, stop in RANGES for first in range(start, stop, block))


def test_two_workers_at_different_speeds_claim_each_block_once_an_epoch_the_fast_one_the_slows_from_its_back():
    ledger = Ledger(RANGES, 64, shuffle=False)  # in order: each range's blocks front to back
    by_epoch, held = {}, {0: [], 1: []}
    for turn in range(40):  # worker 0 claims three blocks for each of worker 1's, reporting the last one read
        worker = 1 if turn % 4 == 3 else 0
        (grant,) = ledger.claim(worker, 1, [g.ticket for g in held[worker]])
        held[worker] = [grant]
        by_epoch.setdefault(grant.epoch, []).append((worker, grant))
    assert len(by_epoch) >= 4
    for epoch, grants in by_epoch.items():
        claimed = blocks_of(g for _, g in grants)
        if epoch < max(by_epoch):
            assert claimed == everyone(), epoch  # every block of the epoch once
        else:
            assert len(set(claimed)) == len(claimed) and set(claimed) <= set(everyone())
    first = [(worker, g.owner, g.first) for worker, g in by_epoch[0]]
    # worker 0 its own four, then worker 1's from the back (392, then 328) while worker 1 reads from its front
    assert first[:3] == [(0, 0, 0), (0, 0, 64), (0, 0, 128)] and (1, 1, 200) in first, first
    stolen = [f for worker, owner, f in first if worker == 0 and owner == 1]
    assert stolen[:2] == [392, 328], first
    assert sum(ledger.taken[0].values()) > 0 and not ledger.taken[1]
    read = ledger.epochs()
    assert all(records == 400 and not twice for records, _, twice in read[:2]), read
    line = ledger.line()
    assert re.search(r"\): \d+ of \d+ job epochs of 400 begun read whole, each record once \(epoch \d+: \d+ read",
                     line), line
    assert "worker 0 " in line and "of worker 1's" in line, line


def test_the_next_epoch_begins_once_every_block_is_claimed_own_blocks_first_in_the_seeds_order():
    ledger = Ledger(RANGES, 64, seed=3)
    epoch0 = ledger.claim(0, 4) + ledger.claim(1, 4)
    assert {g.epoch for g in epoch0} == {0} and blocks_of(epoch0) == everyone()
    (next_one,) = ledger.claim(1, 1)
    assert next_one.epoch == 1 and next_one.owner == 1  # its own range first in the new epoch
    again = Ledger(RANGES, 64, seed=3)
    assert again.claim(0, 4) + again.claim(1, 4) == epoch0  # the seed repeats the order
    other = Ledger(RANGES, 64, seed=4)
    assert [g.first for g in other.claim(0, 4)] != [g.first for g in epoch0[:4]]


def test_a_workers_unread_blocks_go_back_and_are_handed_out_first():
    ledger = Ledger(RANGES, 64, shuffle=False)
    slow = ledger.claim(1, 2)
    read = ledger.claim(0, 4)
    assert ledger.give_back(1) == 2 and ledger.give_back(1) == 0
    back = ledger.claim(0, 2, [g.ticket for g in read])
    assert blocks_of(back) == blocks_of(slow) and {g.epoch for g in back} == {0}
    assert ledger.claim(1, 2)[0].epoch == 0  # what is left of epoch 0: worker 1's last two blocks
    assert "2 blocks went back from workers that left" in ledger.line()


def test_a_claim_of_a_worker_outside_the_job_or_of_a_ticket_it_does_not_hold_changes_nothing():
    ledger = Ledger(RANGES, 64)
    with pytest.raises(ValueError, match="worker 2 has no record range"):
        ledger.claim(2, 1)
    (grant,) = ledger.claim(0, 1)
    for done in ([grant.ticket + 1], [grant.ticket, grant.ticket]):
        with pytest.raises(ValueError, match="which it does not hold"):
            ledger.claim(0, 1, done)
    with pytest.raises(ValueError, match="which it does not hold"):
        ledger.claim(1, 1, [grant.ticket])  # another worker's
    assert ledger.claim(0, 1, [grant.ticket])[0].ticket == grant.ticket + 1


@pytest.mark.parametrize("payload, why", [
    (b"", "shorter than"), (P.CLAIM_HEAD.pack(0, 0), "CLAIM of 0 blocks"),
    (P.CLAIM_HEAD.pack(P.MAX_CLAIM + 1, 0), "CLAIM of 65 blocks"),
    (P.CLAIM_HEAD.pack(1, 2) + P.TICKET.pack(1), "with 2 tickets in 16 bytes"),
    (P.CLAIM_HEAD.pack(1, 0) + b"\0", "in 9 bytes")])
def test_a_claim_that_is_not_what_its_head_says_is_refused(payload, why):
    with pytest.raises(P.ProtocolError, match=why):
        P.decode_claim(payload)


def test_grants_outside_the_job_or_more_than_claimed_are_refused_and_oversized_frames_at_their_header():
    good = P.GRANT.pack(1, 0, 1, 64, 200)
    assert P.decode_grants(good, 1, 2, 400) == [(1, 0, 1, 200, 64)]
    for payload, wanted, why in ((good[:-1], 1, "bytes for a claim"), (good * 2, 1, "bytes for a claim"),
                                 (P.GRANT.pack(1, 0, 2, 64, 0), 1, "not in the job's 2 ranges"),
                                 (P.GRANT.pack(1, 0, 1, 64, 380), 1, r"records \[380, 444\)"),
                                 (P.GRANT.pack(1, 0, 1, 0, 0), 1, "not in the job's")):
        with pytest.raises(P.ProtocolError, match=why):
            P.decode_grants(payload, wanted, 2, 400)
    for type_, length in ((P.CLAIM, 8 + 8 * P.MAX_CLAIM + 8), (P.CLAIMED, 32 * P.MAX_CLAIM + 1), (P.CLAIM, 4)):
        header = P.HEADER.pack(P.MAGIC, P.VERSION, type_, 0, 0, 0, length, 0.0)
        with pytest.raises(P.ProtocolError, match="allowed"):
            P.decode_header(header, 400)


def served(ledger=None):
    handler = EasgdHandler(0.5)
    handler.ledger = ledger
    return ExchangeServer(np.zeros(100, np.float32), SECRET, handler, timeout=10.0)


def test_workers_claim_through_the_exchanger_garbage_ends_a_connection_and_a_closed_ones_blocks_go_back():
    ledger = Ledger(RANGES, 64, shuffle=False)
    with served(ledger) as server:
        slow, fast = (ExchangeClient(server.address, SECRET, w, timeout=10.0).connect(100) for w in (1, 0))
        held, at = slow.claim(2, [], 2, 400)
        assert [(owner, first, count) for _, _, owner, first, count in held] == [(1, 200, 64), (1, 264, 64)]
        assert at == slow.connections == 1
        with pytest.raises(P.RefusedError, match="which it does not hold"):
            fast.claim(1, [held[0][0]], 2, 400)  # another's ticket: declined, the connection goes on
        mine, _ = fast.claim(4, [], 2, 400)
        assert [first for _, _, _, first, _ in mine] == [0, 64, 128, 192]
        fast._conn.send(P.CLAIM, P.CLAIM_HEAD.pack(0, 0))  # garbage: the server says why and ends the connection
        with pytest.raises(P.RefusedError, match="CLAIM of 0 blocks"):
            fast.claim(1, [], 2, 400)
        stolen, at = fast.claim(2, [t for t, *_ in mine], 2, 400)  # connected again, its tickets went back
        assert at == fast.connections == 2 and [first for *_, first, _ in stolen] == [0, 64]
        slow._drop()  # its connection lost: its two blocks unread go back, and the others take them first
        for _ in range(100):
            if ledger.returned >= 6:
                break
            time.sleep(0.05)
        back, _ = fast.claim(4, [], 2, 400)  # the rest of its own that went back, then the slow one's
        assert [first for *_, first, _ in back] == [128, 192, 200, 264]
        fast.close()  # done training (BYE): what it holds, read in part, stays claimed
    assert any("CLAIM of 0 blocks" in reason for _, reason in server.refused)
    assert ledger.returned == 6 and ledger.claim(1, 1)[0].first == 328  # worker 1's last block of epoch 0


def test_a_job_without_a_ledger_declines_a_claim():
    with served() as server:
        client = ExchangeClient(server.address, SECRET, 0, timeout=10.0).connect(100)
        with pytest.raises(P.RefusedError, match="keeps no ledger"):
            client.claim(1, [], 2, 400)
        client.close()


NET_DATA = 'name: "d" type: "Data" top: "data" top: "label" data_param {{ source: "{source}" batch_size: 10 }}'


def numbered_lmdb(path, first, stop):
    """An LMDB at `path` of records first..stop-1 (1x8x8), each labelled with its number, keyed as in the source."""
    rng = np.random.default_rng(first)
    write_lmdb(str(path), [(b"%08d" % i, encode_datum(rng.integers(0, 255, (1, 8, 8), dtype=np.uint8), i))
                           for i in range(first, stop)])
    return str(path)


def test_two_feeders_read_exactly_the_blocks_granted_them_the_fast_one_its_own_and_the_slows(tmp_path):
    source = numbered_lmdb(tmp_path / "source_lmdb", 0, 400)
    ledger, granted = Ledger(RANGES, 16, seed=7), {0: [], 1: []}
    feeders = {}
    for worker, (start, stop) in enumerate(RANGES):
        spill = numbered_lmdb(tmp_path / f"spill{worker}_lmdb", start, stop)  # its own range, as its spill holds it
        layer = text_format.Parse(NET_DATA.format(source=spill), pb.LayerParameter())
        feeder = DataFeeder(layer, seed=worker, shuffle="blocks", memory_limit=0 if worker else None)

        def claim(wanted, done, worker=worker):
            grants = ledger.claim(worker, wanted, done)
            granted[worker].extend(grants)
            return [tuple(g) for g in grants], 1

        feeder.steal(claim, lambda: 1, source, (start, stop))
        feeders[worker] = feeder
    read = {0: [], 1: []}
    for turn in range(200):  # worker 0 reads five batches for each of worker 1's
        worker = 1 if turn % 6 == 5 else 0
        read[worker].extend(feeders[worker].next_batch()["label"].astype(int))
    assert len([epoch for epoch in ledger.epochs() if epoch[0] == 400]) >= 3
    for worker, feeder in feeders.items():
        # what it read and what it holds unread are the records of the blocks granted it, each once
        unread = [int(label) for block in feeder._claimed._blocks for label in block[4][block[5][block[6]:]]]
        records = [i for g in granted[worker] for i in range(g.first, g.first + g.count)]
        assert sorted(read[worker] + unread) == sorted(records), worker
        feeder.close()
    assert any(label >= 200 for label in read[0])  # the fast worker read the slow one's records
    assert read[0][:10] != sorted(read[0][:10])  # shuffled within the blocks held


# The Recorder, its workers waiting before their first step for the file `go` beside the folder it writes to (the
# throttle, looking at /proc from a loaded machine, could find a worker only after the job), then 20 ms a step: the
# tiny net's 100 iterations alone pass in a few of the throttle's 0.3 s periods, too few for a tenth's share to tell.
STOLEN_RECORDER = RECORDER.replace("import os", "import os\nimport time").replace(
    "    def forward(self, bottom, top):\n",
    "    def forward(self, bottom, top):\n"
    "        deadline = time.monotonic() + 60\n"
    "        while not os.path.exists(os.path.join(os.path.dirname(self.param_str), 'go')) and "
    "time.monotonic() < deadline:\n"
    "            time.sleep(0.02)\n"
    "        time.sleep(0.02)\n")

# 1x256x256 records (64 KB each): a block, 4 MB of records, is 64 of them, and each worker's range of 200 is four
# blocks; the net crops them to 8x8. Record i is labelled i, so the labels the Recorder layer writes name the records.
STOLEN_NET = RECORDED_NET.replace("transform_param {{ scale", "transform_param {{ crop_size: 8 scale")
STOLEN_ITER = 100  # 2 workers x 100 iterations x 10 = 2,000 records read: five job epochs of 400


@pytest.mark.spark
def test_a_stragglers_unread_records_are_read_by_the_other_worker_each_record_once_a_job_epoch(tmp_path):
    rng = np.random.default_rng(0)
    source = str(tmp_path / "train_lmdb")
    write_lmdb(source, ((b"%08d" % i, encode_datum(rng.integers(0, 255, (1, 256, 256), dtype=np.uint8), i))
                        for i in range(400)))
    (tmp_path / "seen").mkdir()
    (tmp_path / "order_recorder.py").write_text(STOLEN_RECORDER)
    (tmp_path / "net.prototxt").write_text(STOLEN_NET.format(train=source, seen=tmp_path / "seen"))
    (tmp_path / "solver.prototxt").write_text(RECORDED_SOLVER.format(net=tmp_path / "net.prototxt",
                                                                     prefix=tmp_path / "out" / "stolen")
                                              .replace("max_iter: 24", f"max_iter: {STOLEN_ITER}"))
    # The first worker to connect runs a tenth of the time from before its first step: the straggler.
    returncode, log, straggler = train_with_straggler(str(tmp_path / "solver.prototxt"), share=0.1,
                                                      go=tmp_path / "go")
    assert returncode == 0 and workers_done(log) == [0, 1] and straggler is not None, log[-3000:]
    assert "Work stealing: on; the workers claim blocks of 64 records" in log, log[-3000:]
    assert "blocks of 4 MB of records through a 8 MB shuffle buffer" in log
    ledger = re.search(r"Records read through the job's ledger \(blocks of 64 records\): (\d+) of (\d+) job epochs "
                       r"of 400 begun read whole, each record once(.*)", log)
    assert ledger and int(ledger.group(1)) >= 2 and "read twice" not in ledger.group(3), log[-3000:]
    whole, begun = int(ledger.group(1)), int(ledger.group(2))
    read = {int(name.split(".")[0]): np.array((tmp_path / "seen" / name).read_text().split(), dtype=int)
            for name in os.listdir(tmp_path / "seen")}
    slow = read.pop(straggler)
    (fast,) = read.values()
    assert len(slow) + len(fast) == 10 * 2 * STOLEN_ITER
    iterations = {int(w): int(n) for w, n in re.findall(r"Worker (\d) on \S+ \(in [^)]*\): (\d+) iterations", log)}
    assert 10 * min(iterations.values()) == len(slow) < len(fast) == 10 * max(iterations.values()), iterations
    own = 200 * min(iterations, key=iterations.get)  # the straggler's record range
    assert ((fast >= own) & (fast < own + 200)).any(), (own, fast)  # the other read the straggler's records
    # every record once in each epoch read whole, and at most once in each epoch begun
    counts = np.bincount(np.concatenate([slow, fast]), minlength=400)
    assert whole <= counts.min() and counts.max() <= begun, (whole, begun, counts)
    assert re.search(rf"worker {1 - own // 200} \d+ of worker {own // 200}'s", ledger.group(3)), ledger.group(3)


def test_a_job_steals_where_easgd_reads_an_lmdb_every_executor_reads_and_says_why_not_elsewhere(tmp_path):
    solver = load_solver(make_job(tmp_path, train_records=200))
    ds = solver.param.deepspark_param
    plan, line = stealing(ds, Easgd(), solver, None, 2)
    ranges, block = plan
    assert [(r.start, r.stop) for r in ranges] == [(0, 100), (100, 200)] and block == (4 << 20) // 64
    assert line.startswith(f"Work stealing: on; the workers claim blocks of {block} records")
    parquet = numbered_lmdb(tmp_path / "other_lmdb", 0, 10)
    write_records(str(tmp_path / "train.parquet"), read_records(parquet))
    for algorithm, knobs, workers, data, why in (
            (Sync(), {}, 2, None, "sync's workers train in step"),
            (Easgd(), {"steal_records": False}, 2, None, "steal_records is off"),
            (Easgd(), {}, 1, None, "one worker reads every record"),
            (Easgd(), {"ship_records": True}, 2, None, "ship_records: the executors need not see the LMDB"),
            (Easgd(), {}, 2, str(tmp_path / "train.parquet"), "a parquet source's shards are spilled to each "
                                                               "executor, which no other reads")):
        off = pb.DeepSparkParameter()
        off.CopyFrom(ds)
        for name, value in knobs.items():
            setattr(off, name, value)
        assert stealing(off, algorithm, solver, data, workers) == (
            None, f"Work stealing: off ({why}); each worker reads its own shard")


def test_a_stealing_feeder_has_no_position_of_its_own_to_hand_on_or_move_on(tmp_path):
    source = numbered_lmdb(tmp_path / "source_lmdb", 0, 40)
    layer = text_format.Parse(NET_DATA.format(source=source), pb.LayerParameter())
    ledger = Ledger([(0, 40)], 16)
    with DataFeeder(layer, seed=0, shuffle="blocks") as feeder:
        feeder.steal(lambda wanted, done: ([tuple(g) for g in ledger.claim(0, wanted, done)], 1), lambda: 1, source,
                     (0, 40))
        assert feeder.skip(3)  # nothing to move on: the ledger says where the job's reading stands
        with pytest.raises(ValueError, match="a stealing feeder has no single position"):
            feeder.get_state()
        seen = np.concatenate([feeder.next_batch()["label"] for _ in range(8)]).astype(int)
        assert sorted(seen[:40]) == list(range(40)) and feeder.epoch >= 1  # one job epoch, then the next


def test_a_feeder_drops_the_blocks_granted_on_a_connection_the_worker_has_since_made_again(tmp_path):
    source = numbered_lmdb(tmp_path / "source_lmdb", 0, 40)
    layer = text_format.Parse(NET_DATA.format(source=source), pb.LayerParameter())
    ledger, connection = Ledger([(0, 40)], 8, shuffle=False), [1]
    with DataFeeder(layer, seed=0, shuffle=False) as feeder:
        feeder.steal(lambda wanted, done: ([tuple(g) for g in ledger.claim(0, wanted, done)], connection[0]),
                     lambda: connection[0], source, (0, 40))
        assert list(feeder.next_batch()["label"].astype(int)) == list(range(10))  # in order: blocks 0 and 1
        ledger.give_back(0)  # as the exchanger does when the worker joins again on a new connection
        connection[0] = 2
        # what it held went back, and it reads it again from the start (those it read: read twice, on a loss only)
        assert list(feeder.next_batch()["label"].astype(int)) == list(range(10))
        assert feeder._claimed.dropped == 1  # block 1, read in part (block 0, read whole, was not yet reported)
        assert list(feeder.next_batch()["label"].astype(int)) == list(range(10, 20))
