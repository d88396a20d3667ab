# megatron-sap: install into .venv/ and run the suite on CPU.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_FLAGS ?= -q
TORCH_PIP_ARGS ?=

.PHONY: install test test-compat demo bench gpu-check clean

install:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH (or set PYTHON=...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	# The CPU build of torch: this project's machines find it on local disk (pip's find-links);
	# elsewhere pass TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu", as a bare
	# 'torch' from PyPI is the multi-GB CUDA build.
	$(PY) -m pip install -q $(TORCH_PIP_ARGS) "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -c "import torch, megatron.core, megatron_sap; print('installed torch', torch.__version__, 'megatron-core', megatron.core.__version__)"

test:
	OMP_NUM_THREADS=1 $(PY) -m pytest $(PYTEST_FLAGS) tests

# The Megatron tests on the other megatron-core releases SAP supports (`make test` runs the
# installed 0.16.1): each release goes into .cache/ (scripts/megatron_core_release.py) and shadows
# the installed one on PYTHONPATH. 0.17.1 and 0.18.2 pass too; not run by default, to keep CI
# under 20 minutes (each release takes about 2 here).
MCORE_COMPAT ?= 0.13.1 0.14.0 0.15.3 0.19.0
test-compat:
	@for v in $(MCORE_COMPAT); do \
		echo "megatron-core $$v"; \
		path=$$($(PY) scripts/megatron_core_release.py $$v .cache) || exit 1; \
		OMP_NUM_THREADS=1 PYTHONPATH=$$path $(PY) -m pytest $(PYTEST_FLAGS) tests/test_megatron_*.py || exit 1; \
	done

demo:
	OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore::UserWarning $(PY) -m megatron_sap.demo

bench:
	OMP_NUM_THREADS=1 $(PY) -m megatron_sap.bench

gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
