PYTHON ?= python

.PHONY: install test proto bench bench-all clean

# The CPU build of torch 2.13 is pinned first so that no dependency pulls a multi-GB CUDA build.
install:
	$(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e '.[dev]'

test:
	$(PYTHON) -m pytest -q tests

# Regenerate the gRPC stubs in appliance/serve/api/ from protos/ (tests fail when they drift).
proto:
	$(PYTHON) -m appliance.serve.api.generate

bench:
	$(PYTHON) bench/bench_plan_sweep.py

# Every benchmark BENCHMARKS.md reports, N interleaved runs each, into bench/results/<UTC time>/ (about 20 min on a
# quiet 2-core machine). A subset: make bench-all BENCH_ARGS="--only engine,grpc --runs 1"; the list: --list.
bench-all:
	$(PYTHON) bench/run_all.py $(BENCH_ARGS)

clean:
	rm -rf outputs multirun .pytest_cache build *.egg-info
