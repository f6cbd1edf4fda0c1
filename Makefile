# The two set-up commands of the README:
#   make demo   creates .venv, starts tandem up, plays the bundled positions, prints the report, stops
#               (CONFIG=PATH: a config of your own, e.g. other ports where the default ones are taken)
#   make test   creates .venv with the test extra and runs the tests (what CI runs; ARGS="..." goes to pytest)
# Both install ONNX Runtime through one of two extras: gpu (onnxruntime-gpu, CuPy,
# NVML) where nvidia-smi lists a CUDA GPU, cpu (onnxruntime) elsewhere. FLAVOUR=cpu
# or FLAVOUR=gpu chooses by hand.
PYTHON  ?= python3
VENV    ?= .venv
CONFIG  ?=
ARGS    ?=
BIN      = $(VENV)/bin
FLAVOUR ?= $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo gpu || echo cpu)
ifeq ($(FLAVOUR),gpu)
WHY = nvidia-smi lists a CUDA GPU: onnxruntime-gpu and CuPy, the search on the GPU
OTHER_ORT = onnxruntime
else
WHY = no CUDA GPU listed by nvidia-smi: onnxruntime (CPU build), the search on the CPU
OTHER_ORT = onnxruntime-gpu
endif
# Both ONNX Runtime builds install the module `onnxruntime`: the other one goes first.
SWAP_ORT = $(BIN)/python -m pip uninstall -q -y $(OTHER_ORT) 2>/dev/null || true

.PHONY: demo test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed-$(FLAVOUR): pyproject.toml | $(BIN)/python
	@echo "tandem: installing the $(FLAVOUR) extra ($(WHY))"
	$(SWAP_ORT)
	$(BIN)/python -m pip install -q -e '.[$(FLAVOUR)]'
	touch $@

$(VENV)/.installed-test-$(FLAVOUR): pyproject.toml | $(BIN)/python
	@echo "tandem: installing the test and $(FLAVOUR) extras ($(WHY))"
	$(SWAP_ORT)
	$(BIN)/python -m pip install -q -e '.[test,$(FLAVOUR)]'
	touch $@

demo: $(VENV)/.installed-$(FLAVOUR)
	$(BIN)/tandem demo --frames 600 --report runs/demo_report.json --log-dir runs/logs $(if $(CONFIG),--config $(CONFIG))

test: $(VENV)/.installed-test-$(FLAVOUR)
	$(BIN)/python -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) runs
