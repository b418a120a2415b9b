"""bench/tf_speed.py: its Xception-sized depthwise stack and its MTCNN nets answer alike on both backends and
pycaffe, and every figure it prints is there (no timing is asserted)."""

import pytest

from conftest import load_script

pytestmark = pytest.mark.caffe

pytest.importorskip("tensorflow")
pytest.importorskip("caffe")

bench = load_script("bench/tf_speed.py", "bench_tf_speed")


def test_the_depthwise_stack_agrees_on_both_backends_and_is_timed():
    records = []
    bench.bench_depthwise(1, None, records.append)  # threads as the process has them
    assert [r.get("backend") for r in records] == ["caffe", "tensorflow", None]
    assert all(r["first_forward_s"] > 0 for r in records[:2])
    assert records[2]["outputs_agree"] is True and records[2]["ratio_tf_vs_caffe"] > 0


@pytest.mark.parametrize("name, shape", [("det2", None), ("det3", None), ("det1", (1, 3, 20, 17))])
def test_the_mtcnn_nets_agree_with_pycaffe_and_each_ratio_is_printed(name, shape):
    records = []
    bench.bench_mtcnn(name, shape, 1, 0.05, None, records.append)
    rates = {r["impl"]: r["images_per_s"] for r in records if "images_per_s" in r}
    assert set(rates) == {"deepspark_tf", "deepspark_caffe", "pycaffe"} and min(rates.values()) > 0
    ratios = [r for r in records if "ratio_vs_pycaffe" in r]
    assert [r["impl"] for r in ratios] == ["deepspark_tf", "deepspark_caffe"]
    assert all(r["outputs_agree"] is True for r in ratios)


def test_the_floor_of_a_tensorflow_call_is_printed_for_each_path():
    records = []
    bench.bench_floor(1, 0.05, None, records.append)
    assert [r["impl"] for r in records] == ["tf.function", "concrete_function", "direct_call"]
    assert all(r["us_per_call"] > 0 for r in records)
