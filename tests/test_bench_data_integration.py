"""bench/data_integration.py's summary line and results-page section, from records shaped as its runs write them."""


from conftest import load_script

bench = load_script("bench/data_integration.py", "bench_data_integration")


def a_run(source, images, wall, spill, share, ready=1.0):
    return dict(bench="data_integration", source=source, images_per_s=images, wall_seconds=wall, spill_seconds=spill,
                spill_share=share, ready_seconds=ready, ready_share=ready / 20, records=60000)


def test_medians_and_ratios_against_lmdb_make_the_page_table(tmp_path):
    runs = [a_run("lmdb", 4000.0, 30.0, 1.0, 0.05), a_run("parquet", 3000.0, 36.0, 1.5, 0.06),
            a_run("dataframe", 2000.0, 45.0, 2.0, 0.08), a_run("lmdb", 5000.0, 34.0, 1.2, 0.07),
            a_run("parquet", 3000.0, 40.0, 1.5, 0.06), a_run("dataframe", 2500.0, 47.0, 2.0, 0.1, 8.0)]
    sources = bench.comparison(runs)
    assert list(sources) == ["lmdb", "parquet", "dataframe"]
    assert sources["lmdb"] == dict(images_per_s=4500.0, wall_seconds=32.0, spill_seconds=1.1, spill_share=0.06, ready_seconds=1.0,
                                   ready_share=0.05, runs=2, images_per_s_vs_lmdb=1.0, wall_vs_lmdb=1.0)
    assert sources["dataframe"]["images_per_s_vs_lmdb"] == 0.5 and sources["dataframe"]["wall_vs_lmdb"] == 1.438
    summary = dict(bench="data_integration", figure="comparison", workers=2, iterations=469, sources=sources,
                   load_average=[1.52, 2.0], cores=2)
    text = bench.page_section(runs + [summary], str(tmp_path))
    assert "| lmdb | 4,500 | 1.00x | 1.10 s | 6.0% | 1.0 s (5.0%) | 32.0 s (1.00x) |" in text
    assert "| dataframe | 2,250 | 0.50x | 2.00 s | 9.0% | 4.5 s (22.5%) | 46.0 s (1.44x) |" in text
    assert "data_integration.jsonl" in text and "medians of 2 runs per source" in text and "469 iterations" in text
    assert bench.page_section(runs, str(tmp_path)).startswith("_Not measured yet")
