PYTHON ?= python

.PHONY: install test proto bench clean

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

clean:
	rm -rf outputs multirun .pytest_cache build *.egg-info
