# The two set-up commands of the README:
#   make demo   creates .venv, starts tandem up, plays the bundled positions, prints the report, stops
#   make test   creates .venv with the test extra and runs the tests (what CI runs)
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin

.PHONY: demo test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/tandem demo --frames 600 --report runs/demo_report.json --log-dir runs/logs

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs
