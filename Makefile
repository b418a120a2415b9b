# DeepSpark's commands. `make demo` and `make test` set up everything they need
# (venv, pip packages, Debian packages, pycaffe, the Fashion-MNIST LMDBs) and
# skip what is already done, so a second run starts at once.

PYTHON  ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMPS  := .stamps
DATA    := data
FASHION := /usr/share/datasets/fashion-mnist
PYTEST_ARGS ?=

.PHONY: help setup system venv caffe data jvm-archive test test-fast demo docs bench bench-all bench-smoke peers-env proto pack-env clean

help:
	@echo "make demo    LeNet on Fashion-MNIST: 2 Spark workers, async EASGD, local[2]"
	@echo "make test    the test suite (sets up venv, Debian packages, pycaffe, data)"
	@echo "make test-fast  every test that needs no JVM and no pycaffe (no Spark, no Caffe build), in minutes"
	@echo "make bench   docs/results.md: DeepSpark against its peers (QUICK=1: a subset); make bench-all: every bench"
	@echo "make bench-smoke  every bench's smallest run, end to end (minutes; CI runs it after the tests)"
	@echo "make docs    the documentation site (mkdocs.yml, docs/) in site/"
	@echo "make caffe   build pycaffe into $(VENV) (cached in ~/.cache/deepspark)"
	@echo "make proto   regenerate deepspark/proto from proto/deepspark.proto"
	@echo "make pack-env  dist/deepspark-env.tar.gz: the executors' Python for --executor-env (venv-pack)"

setup: system venv caffe data jvm-archive

system: $(STAMPS)/system
$(STAMPS)/system: tools/setup-system.sh
	@bash tools/setup-system.sh
	@mkdir -p $(STAMPS) && touch $@

venv: $(STAMPS)/venv
$(STAMPS)/venv: setup.py constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "[venv] installing deepspark and its test dependencies into $(VENV)"
	@$(BIN)/python -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[tensorflow,test,bench,caffe]'
	@mkdir -p $(STAMPS) && touch $@

# Always run: the script takes a third of a second when its cached build exists,
# and it relinks a recreated venv to the cache.
caffe: $(STAMPS)/system $(STAMPS)/venv
	@bash tools/build-caffe.sh $(VENV)

# The classes a Spark driver's JVM loads as it starts, archived once for the JDK to map (a faster
# SparkContext: bench/startup.py measures it); kept in ~/.cache/deepspark, and the script returns at once
# when it is there.
jvm-archive: $(STAMPS)/venv
	@$(BIN)/python tools/jvm-archive.py

data: $(DATA)/fashion_mnist_train_lmdb $(DATA)/fashion_mnist_test_lmdb
$(DATA)/fashion_mnist_train_lmdb: | $(STAMPS)/venv $(STAMPS)/system
	@mkdir -p $(DATA)
	$(BIN)/deepspark convert-mnist $(FASHION)/train-images-idx3-ubyte.gz $(FASHION)/train-labels-idx1-ubyte.gz $@
$(DATA)/fashion_mnist_test_lmdb: | $(STAMPS)/venv $(STAMPS)/system
	@mkdir -p $(DATA)
	$(BIN)/deepspark convert-mnist $(FASHION)/t10k-images-idx3-ubyte.gz $(FASHION)/t10k-labels-idx1-ubyte.gz $@

# Two test processes (pytest-xdist): most tests wait on a JVM, a socket or a subprocess, and two keep both
# cores busy; more would crowd the Spark tests (each runs two workers) on a machine this size.
# --dist loadscope sends each module whole to one process, so that a module's fixture (a trained model,
# a standalone cluster, a Spark session) is set up once: split across processes, or interleaved with
# other modules' tests, it was set up twice (minutes of the suite). --no-loadscope-reorder keeps conftest.py's
# order (modules with a slow test first, then Spark's), not xdist's (most tests first), so the long ones start early.
TEST_PROCESSES ?= 2
test: setup
	$(BIN)/python -m pytest -n $(TEST_PROCESSES) --dist loadscope --no-loadscope-reorder --durations=15 $(PYTEST_ARGS)

# The fast tier: every test not marked `spark` or `caffe` (conftest.py's --fast). A JVM or pycaffe in one of them
# fails it, so that the markers stay complete; it needs no pycaffe build and no JVM class archive. Two processes,
# each module whole to one, as `make test` runs them.
test-fast: system venv data
	$(BIN)/python -m pytest --fast -n $(TEST_PROCESSES) --dist loadscope --no-loadscope-reorder --durations=15 $(PYTEST_ARGS)

demo: setup
	$(BIN)/python tools/demo.py

# The documentation site from docs/ (mkdocs.yml): warnings are errors, as in the suite's build of it. It needs a small
# venv of its own (requirements-docs.txt: 63 MB, 17 s to make; mkdocstrings reads the docstrings without importing
# deepspark), not the library's 2.9 GB.
DOCS_VENV := build/docs-venv
docs: $(DOCS_VENV)/installed
	$(DOCS_VENV)/bin/python -m mkdocs build --strict

$(DOCS_VENV)/installed: requirements-docs.txt constraints.txt
	$(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/pip install -q -r requirements-docs.txt -c constraints.txt
	touch $@

# The external peers (#14: Elephas, TorchDistributor) run in a venv of their own: elephas pins TensorFlow < 2.20.
peers-env:
	@bash tools/peers-env.sh

# The benchmarks behind docs/results.md (#14, #27), each writing docs/data/NAME.jsonl afresh, then the page from them
# (and the README's comparison); docs/data/timing.jsonl says how long each took (timing_quick.jsonl for QUICK=1,
# so that the page can say both). One BLAS thread, so that numpy's own threads do not blur the figures. QUICK=1:
# each bench's --quick subset.
PAGE_BENCHES := startup seal plan_check communication time_to_accuracy peers network backends data_integration
QUICK ?=
TIMING = docs/data/timing$(if $(QUICK),_quick).jsonl
# The page's hour (#44): bench/network.py without 10 Gbit/s (the loopback runs of time_to_accuracy stand for a fast
# link) and without easgd at periods 1 and 64 (the exchange's share by period is communication's section): ~11 of
# its 32 minutes; the rest of its runs as they were.
PAGE_FLAGS_network := --networks 1G,100M --runs "easgd period 10,sync,average period 10,easgd period 10, learning rate \
	x2,sync, learning rate x2,average period 10, learning rate x2,easgd period 32, int4, learning rate x2,easgd period \
	10, int8,sync, int8,easgd period 32, int4"
bench: setup peers-env
	@mkdir -p docs/data
	@rm -f $(TIMING)
	@for b in $(PAGE_BENCHES); do echo "== bench/$$b.py"; rm -f docs/data/$$b.jsonl; began=$$(date +%s); \
	    flags=; [ "$$b" = network ] && flags='$(PAGE_FLAGS_network)'; \
	    eval "OPENBLAS_NUM_THREADS=1 $(BIN)/python bench/$$b.py $(if $(QUICK),--quick,$$flags) --out docs/data/$$b.jsonl" \
	        || exit 1; \
	    echo "{\"bench\": \"$$b\", \"seconds\": $$(( $$(date +%s) - began )), \"quick\": $(if $(QUICK),true,false)}" \
	        >> $(TIMING); done
	@$(BIN)/python bench/_page.py

# Every benchmark in bench/ (docs/measured.md's figures; some take long: data_scale writes GBs), JSON
# lines in bench/results/. A module of bench/ whose name starts with "_" is not a benchmark.
BENCHES := $(sort $(basename $(notdir $(wildcard bench/[!_]*.py))))
bench-all: setup peers-env
	@mkdir -p bench/results
	@for b in $(BENCHES); do echo "== bench/$$b.py"; OPENBLAS_NUM_THREADS=1 $(BIN)/python bench/$$b.py || exit 1; done

# Every bench of bench-all in its smallest run (#44; .ci/run runs it after the tests): each runs end to end and
# prints its JSON lines, which go to a temporary folder (never bench/results, bench/measured*.jsonl or docs/data);
# its figures mean nothing. A bench's own --smoke, or the flags SMOKE_<bench> gives it. It never builds the peers'
# venv: without bench/.venv-peers (make peers-env) the peers are skipped, in one line. tests/test_bench_smoke.py
# checks that every bench has its smoke run here.
SMOKE_tf_speed := --quick --rounds 1
SMOKE_SECONDS ?= 900
bench-smoke: setup
	@out=$$(mktemp -d "$${TMPDIR:-/tmp}/deepspark-bench-smoke.XXXXXX"); began=$$(date +%s); \
	$(foreach b,$(BENCHES),echo "== bench/$(b).py $(or $(SMOKE_$(b)),--smoke)"; at=$$(date +%s); \
	    OPENBLAS_NUM_THREADS=1 timeout $(SMOKE_SECONDS) $(BIN)/python bench/$(b).py $(or $(SMOKE_$(b)),--smoke) \
	        --out $$out/$(b).jsonl || { echo "bench-smoke: bench/$(b).py failed"; exit 1; }; \
	    echo "== bench/$(b).py: $$(( $$(date +%s) - at )) s";) \
	echo "bench-smoke: $(words $(BENCHES)) benches ran end to end in $$(( $$(date +%s) - began )) s; JSON lines in $$out"

# The descriptor set keeps the .proto's comments: the generated flags take their help from them.
proto: $(STAMPS)/system
	protoc -Iproto --python_out=deepspark/proto --include_source_info \
	    --descriptor_set_out=deepspark/proto/deepspark.desc proto/deepspark.proto

pack-env: $(STAMPS)/venv
	@bash tools/pack-env.sh dist/deepspark-env.tar.gz

clean:
	rm -rf $(STAMPS) output site
