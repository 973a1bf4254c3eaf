PYTHON ?= python

.PHONY: install test proto bench bench-all soak clean mutation device-check gpu-kernels wheelhouse

# The CPU build of torch 2.13 is installed first, from its CPU index, so that no dependency pulls a multi-GB CUDA
# build (on Linux PyPI's torch is the CUDA one). The last line compiles the CPU kernels into
# ~/.cache/appliance/kernels, so no start waits for the compiler. README "Install" has the CUDA and Ascend lines.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
install:
	$(PYTHON) -m pip install torch==2.13.0 --index-url $(TORCH_INDEX)
	$(PYTHON) -m pip install -e '.[dev]'
	$(PYTHON) -m npu.cpu_kernels

test:
	$(PYTHON) -m pytest -q tests

# On a machine with one NVIDIA GPU (offline is fine): the accelerator checks of bench/device_check.py (tiny models on
# the GPU, greedy == transformers on the GPU, the memory promise at utilization 0.5 and 0.85 in the driver's view,
# serving, tok/s beside transformers), in a few minutes; summary.md/json in DEVICE_CHECK_OUT (default device-check/).
device-check:
	$(PYTHON) bench/device_check.py

# Every Triton kernel compiled for an H100 / H200 (sm_90) on this machine, no GPU needed: each variant the shipped
# models launch, its shared memory, registers and spills; fails on a kernel that does not compile or does not fit,
# a grid past CUDA's limits, or a variant first built while serving. GPU_KERNELS_ARGS="--arch 80" for an A100.
gpu-kernels:
	$(PYTHON) bench/compile_gpu_kernels.py $(GPU_KERNELS_ARGS)

# Every wheel this project needs besides torch, for a host without network (README "Install offline"): run it on a
# connected host; WHEEL_PYTHON / WHEEL_PLATFORM name the offline host's Python and platform. Install there with
# `pip install --no-index --find-links wheelhouse -e '.[dev]'` (its own torch stays: torch >= 2.5).
WHEELHOUSE ?= wheelhouse
WHEEL_PYTHON ?= 3.12
WHEEL_PLATFORM ?= manylinux_2_35_x86_64
wheelhouse:
	$(PYTHON) bench/wheelhouse.py --dest $(WHEELHOUSE) --python-version $(WHEEL_PYTHON) --platform $(WHEEL_PLATFORM)

# Regenerate the gRPC stubs in appliance/serve/api/ from protos/ (tests fail when they drift).
proto:
	$(PYTHON) -m appliance.serve.api.generate

bench:
	$(PYTHON) bench/bench_plan_sweep.py

# Every benchmark BENCHMARKS.md reports, N interleaved runs each, into bench/results/<UTC time>/ (about 20 min on a
# quiet 2-core machine). A subset: make bench-all BENCH_ARGS="--only engine,grpc --runs 1"; the list: --list.
bench-all:
	$(PYTHON) bench/run_all.py $(BENCH_ARGS)

# Soak (never part of `make test`): a real server under mixed load (gRPC streams, cancels, bad requests; HTTP n > 1,
# JSON output, logprobs, chat) with preemption for SOAK_SECONDS (15 min); fails unless it ends idle with every cache
# group's blocks back and RSS flat (at most 16 MiB more than after the warm-up).
SOAK_SECONDS ?= 900
soak:
	SOAK_SECONDS=$(SOAK_SECONDS) $(PYTHON) bench/soak.py $(SOAK_ARGS)

# Mutation testing (docs/TESTING.md): hours of CPU, so never part of `make test` or CI. One module at a time
# (`make mutation-sampler` runs one), each mutant against the fast tests written for its module (the
# *_TESTS lists, node-id prefixes; override one to compare test sets) and ended after MUTATION_TIMEOUT_S
# (tests/mutation_selection.py); the mutmut config is [tool.mutmut] in pyproject.toml. `mutmut results`
# lists the survivors, `mutmut show NAME` shows one.
MUTATION_JOBS ?= 2
MUTMUT = mutmut run --max-children $(MUTATION_JOBS)
REQUEST_TESTS ?= tests/core/test_request.py tests/core/test_request_limits.py tests/core/test_constraint.py
SAMPLER_TESTS ?= tests/npu/test_sampler.py tests/npu/test_sampler_rows.py tests/npu/test_sampler_mask.py
LOOP_TESTS ?= tests/engine/test_stop_rules.py tests/engine/test_engine_faults.py tests/engine/test_loop_rules.py \
	tests/engine/test_loop_partitions.py tests/engine/test_loop_retry.py tests/engine/test_output_processor.py
SCHEDULER_TESTS ?= tests/engine/test_scheduler.py tests/engine/test_scheduler_limits.py \
	tests/engine/test_scheduler_edges.py tests/engine/test_scheduler_partitions.py tests/engine/test_update_from_output.py
KV_TESTS ?= tests/engine/test_kv_cache_manager.py tests/engine/test_kv_cache_manager_props.py \
	tests/engine/test_page_table.py tests/engine/test_kv_pages.py tests/engine/test_block_pool.py \
	tests/engine/test_block_pool_model.py
PLANNER_TESTS ?= tests/core/test_planner.py tests/npu/test_launcher.py tests/core/test_planner_groups.py
SPEC_TESTS ?= tests/core $(KV_TESTS)
QWEN3_TESTS ?= tests/npu/test_qwen3_oracle.py tests/npu/test_fused_paths.py tests/npu/test_qwen3_paging.py
DSV4_TESTS ?= tests/npu/test_dsv4_oracle.py tests/npu/test_dsv4_parts.py tests/npu/test_dsv4_paging.py
MUTATION_MODULES = request sampler loop scheduler kv planner spec qwen3 dsv4
.PHONY: $(addprefix mutation-,$(MUTATION_MODULES))
mutation: $(addprefix mutation-,$(MUTATION_MODULES))
	mutmut results
mutation-request:
	MUTATION_TIMEOUT_S=60 MUTATION_TESTS="$(REQUEST_TESTS)" $(MUTMUT) 'appliance.core.request.*'
mutation-sampler:
	MUTATION_TIMEOUT_S=120 MUTATION_TESTS="$(SAMPLER_TESTS)" $(MUTMUT) 'npu.sampler.*'
mutation-loop:       # the stop rules and the step around them, not startup or the thread plumbing
	MUTATION_TIMEOUT_S=45 MUTATION_TESTS="$(LOOP_TESTS)" $(MUTMUT) 'appliance.engine.output.*' \
		'appliance.engine.step_input.*' 'appliance.engine.core.xǁEngineCoreǁ_step__*' \
		'appliance.engine.core.xǁEngineCoreǁ_sample__*' 'appliance.engine.core.xǁEngineCoreǁ_output__*' \
		'appliance.engine.core.xǁEngineCoreǁ_free__*' 'appliance.engine.core.xǁEngineCoreǁ_run_step__*'
mutation-scheduler:
	MUTATION_TIMEOUT_S=120 MUTATION_TESTS="$(SCHEDULER_TESTS)" $(MUTMUT) 'appliance.engine.scheduler.*'
mutation-kv:
	MUTATION_TIMEOUT_S=120 MUTATION_TESTS="$(KV_TESTS)" \
		$(MUTMUT) 'appliance.engine.block_pool.*' 'appliance.engine.page_table.*' 'appliance.engine.kv_cache_manager.*'
mutation-planner:
	MUTATION_TIMEOUT_S=60 MUTATION_TESTS="$(PLANNER_TESTS)" $(MUTMUT) 'appliance.core.planner.*'
mutation-spec:
	MUTATION_TIMEOUT_S=120 MUTATION_TESTS="$(SPEC_TESTS)" $(MUTMUT) 'appliance.core.kv_cache_spec.*'
mutation-qwen3:      # the paged indexing: block tables to rows, decode buckets, fused-step metadata
	MUTATION_TIMEOUT_S=120 MUTATION_TESTS="$(QWEN3_TESTS)" $(MUTMUT) \
		'npu.qwen3.step_layout.xǁStepLayoutǁbuild__*' 'npu.qwen3.step_layout.x_decode_buckets__*' \
		'npu.qwen3.step_layout.x_fused_step__*' 'npu.qwen3.runner.xǁQwen3Runnerǁ_gather__*' \
		'npu.qwen3.runner.xǁQwen3Runnerǁ_row_offsets__*'
mutation-dsv4:       # DeepSeek V4's paged rows
	MUTATION_TIMEOUT_S=180 MUTATION_TESTS="$(DSV4_TESTS)" $(MUTMUT) 'npu.deepseek_v4.paging.*'

clean:
	rm -rf outputs multirun .pytest_cache build *.egg-info mutants
