PYTHON ?= python

.PHONY: install test proto bench clean mutation

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

# Mutation testing (docs/TESTING.md): hours of CPU, so never part of `make test` or CI. One module at a time
# (`make mutation-sampler` runs one), each mutant against its module's own tests (MUTATION_TESTS) and ended
# after MUTATION_TIMEOUT_S (tests/mutation_selection.py); the mutmut config is [tool.mutmut] in pyproject.toml.
# `mutmut results` lists the survivors, `mutmut show NAME` shows one.
MUTATION_JOBS ?= 2
MUTMUT = mutmut run --max-children $(MUTATION_JOBS)
KV_UNIT_TESTS = tests/engine/test_kv_cache_manager tests/engine/test_page_table.py tests/engine/test_kv_pages.py
SCHEDULER_TESTS = tests/engine/test_scheduler tests/engine/test_engine_oracles.py tests/engine/test_engine_faults.py
LOOP_TESTS = tests/engine/test_stop_rules.py tests/engine/test_engine_faults.py tests/engine/test_engine_oracles.py \
	tests/engine/test_stats.py tests/engine/test_loop_rules.py tests/serve/test_server_engine_faults.py \
	tests/serve/test_server_engine_drain.py
MUTATION_MODULES = request sampler scheduler loop kv spec planner qwen3 dsv4
.PHONY: $(addprefix mutation-,$(MUTATION_MODULES))
mutation: $(addprefix mutation-,$(MUTATION_MODULES))
	mutmut results
mutation-request:
	MUTATION_TIMEOUT_S=120 MUTATION_TESTS="tests/core/test_request tests/serve/test_server_engine_faults.py \
		tests/engine/test_stop_rules.py tests/npu/test_sampler.py" $(MUTMUT) 'appliance.core.request.*'
mutation-sampler:
	MUTATION_TIMEOUT_S=120 MUTATION_TESTS="tests/npu/test_sampler tests/engine/test_engine_oracles.py" \
		$(MUTMUT) 'npu.sampler.*'
mutation-scheduler:
	MUTATION_TIMEOUT_S=120 MUTATION_TESTS="$(SCHEDULER_TESTS)" $(MUTMUT) 'appliance.engine.scheduler.*'
mutation-loop:       # the stop rules and what runs a step around them, not startup or the thread plumbing
	MUTATION_TIMEOUT_S=150 MUTATION_TESTS="$(LOOP_TESTS)" $(MUTMUT) 'appliance.engine.loop.xǁEngineǁ_append__*' \
		'appliance.engine.loop.xǁEngineǁ_finish__*' 'appliance.engine.loop.xǁEngineǁ_execute__*' \
		'appliance.engine.loop.xǁEngineǁ_run_step__*' 'appliance.engine.loop.xǁEngineǁsubmit__*'
mutation-kv:
	MUTATION_TIMEOUT_S=120 MUTATION_TESTS="$(KV_UNIT_TESTS) tests/engine/test_engine_oracles.py" \
		$(MUTMUT) 'appliance.engine.block_pool.*' 'appliance.engine.page_table.*' 'appliance.engine.kv_cache_manager.*'
mutation-spec:
	MUTATION_TIMEOUT_S=120 MUTATION_TESTS="tests/core $(KV_UNIT_TESTS) tests/npu/test_worst_step.py" \
		$(MUTMUT) 'appliance.core.kv_cache_spec.*'
mutation-planner:
	MUTATION_TIMEOUT_S=60 MUTATION_TESTS="tests/core/test_planner tests/npu/test_launcher.py \
		tests/engine/test_kv_cache_manager.py" $(MUTMUT) 'appliance.core.planner.*'
mutation-qwen3:      # the paged indexing: block tables to rows, decode buckets, fused-step metadata
	MUTATION_TIMEOUT_S=120 MUTATION_TESTS="tests/npu/test_qwen3_oracle.py tests/npu/test_fused_paths.py \
		tests/npu/test_worst_step.py tests/engine/test_engine_oracles.py" $(MUTMUT) 'npu.qwen3.xǁ_StepMetaǁbuild__*' \
		'npu.qwen3.x_decode_buckets__*' 'npu.qwen3.x__fused_step__*' 'npu.qwen3.xǁQwen3Runnerǁ_gather__*' \
		'npu.qwen3.xǁQwen3Runnerǁ_row_offsets__*' 'npu.qwen3.xǁQwen3Runnerǁ_planes__*' 'npu.qwen3.xǁQwen3Runnerǁ_arange__*'
mutation-dsv4:       # DeepSeek V4's paged rows
	MUTATION_TIMEOUT_S=180 MUTATION_TESTS="tests/npu/test_dsv4_oracle.py tests/npu/test_dsv4_parts.py \
		tests/engine/test_engine_dsv4_oracle.py" $(MUTMUT) 'npu.dsv4.paging.*'

clean:
	rm -rf outputs multirun .pytest_cache build *.egg-info mutants
