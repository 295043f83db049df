# Set-up and everyday commands. `make lab` and `make test` each do all set-up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install lab lint test test-fast test-isa report bench weights strip clean

# llama-cpp-python (the `llama` extra: llama.cpp itself runs the GGUF files of wb.export in the tests and
# benchmarks) is published as source only: pip compiles llama.cpp here, for this CPU (GGML_NATIVE), the library only
# (no multimodal part, tools, examples or tests): about 3.5 minutes on 2 cores. Without llama.cpp's AMX kernels, whose
# int8 path crashes on small Q8_0 / Q4_0 models (see workbench/export/llama_cpp.py).
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
NO_AMX := $(if $(filter x86_64,$(shell uname -m)),-mno-amx-tile -mno-amx-int8 -mno-amx-bf16)
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF $(if $(NO_AMX),'-DCMAKE_C_FLAGS=$(NO_AMX)' \
  '-DCMAKE_CXX_FLAGS=$(NO_AMX)')

# torch first: keep an existing torch (GPU machines: the venv sees the system site-packages), otherwise
# the local CPU wheel torch==2.13.0, so a CPU-only machine never downloads CUDA packages. Then triton
# (only if absent, so a GPU torch keeps its matching triton), then the package with pinned dependencies.
$(STAMP): pyproject.toml kernels/pyproject.toml constraints.txt
	@if [ ! -x $(BIN)/python ]; then \
	  if $(PYTHON) -c "import torch" 2>/dev/null; then $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else $(PYTHON) -m venv $(VENV); fi; fi
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install torch==2.13.0
	$(BIN)/python -c "import triton" 2>/dev/null || $(BIN)/pip install triton==3.9.0
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(BIN)/pip install -c constraints.txt \
	  -e ./kernels -e ".[dev,ray,llama]"
	$(BIN)/python -m workbench_kernels.build
	touch $(STAMP)

install: $(STAMP)

# the repository is the server's folder (reports/ is browsable in Lab and its Report links work); the printed URL
# (and /) opens the start notebook
lab: install
	$(BIN)/jupyter lab --ip=127.0.0.1 --no-browser --allow-root '--ServerApp.root_dir=$(CURDIR)' \
	  --LabApp.default_url=/lab/tree/notebooks/00_start_here.ipynb

# ruff (style, imports, pyflakes) on all the Python, mypy on the typed core (see [tool.mypy] in pyproject.toml), the
# package's import structure (tests/test_import_structure.py: no private names across sub-packages, no import-time
# cycles)
lint: install
	$(BIN)/ruff check .
	$(BIN)/python -m mypy
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_import_structure.py

# everything, as CI runs it: lint, then every test tier (slow ML claims, notebooks, browser tests; the 30 slowest
# tests listed at the end, to keep CI's time in view), then the other CPU classes' tier
test: install lint
	$(BIN)/python -m pytest --durations=30
	$(MAKE) test-isa

# This machine as the other CPU classes (kernels/workbench_kernels/isa.py: an AVX-512 CPU without AMX, an AVX2-only one -
# caps on PyTorch, oneDNN, MKL and our kernels): the kernels, the quantized and pruned modules, the reload identity,
# the architecture gallery and the goldens of the notebooks whose numbers move most between CPUs (not the 200 M
# parameter memory-bound test: two minutes a class for a claim about bytes, not numerics)
ISA_CLASSES ?= avx512 avx2
ISA_TESTS ?= tests/kernels tests/quantization tests/plans tests/pruning tests/test_gallery.py \
	tests/notebooks/test_notebooks.py::test_notebook_matches_its_goldens[21_pruning_beyond] \
	tests/notebooks/test_notebooks.py::test_notebook_matches_its_goldens[60_llm_decode]
test-isa: install
	@for c in $(ISA_CLASSES); do \
	  echo "== as CPU class $$c: $$($(BIN)/python -m workbench_kernels.isa $$c)"; \
	  env $$($(BIN)/python -m workbench_kernels.isa $$c) $(BIN)/python -m pytest -q -m "not e2e" $(ISA_TESTS) \
	    --ignore=tests/plans/test_memory_bound.py || exit 1; \
	done

# the quick tier (<= 3 min on 2 cores): no slow ML claims, no papermill notebooks, no servers or browser
test-fast: install
	$(BIN)/python -m pytest -m "not slow and not notebook and not e2e"

report: install
	$(BIN)/workbench report notebooks/00_start_here.ipynb

bench: install
	$(BIN)/python -m workbench.benchmarks.measure

weights: install
	$(BIN)/python -m workbench.models.train all

# after editing a lesson in JupyterLab: drop outputs / execution counts before committing (the suite checks)
strip: install
	$(BIN)/python -m workbench.teach.strip notebooks

clean:
	rm -rf $(VENV) reports .pytest_cache .mypy_cache .ruff_cache
