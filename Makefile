PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install demo test test-restricted test-slow bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# llama-cpp-python compiles llama.cpp from its source distribution: GGML_NATIVE builds for this CPU's
# instruction set (-march=native: AVX2/AVX-512/AMX where present). specdec loads libllama and ggml only:
# the multimodal library (LLAVA_BUILD) and llama.cpp's common library (forced on by llama-cpp-python's
# CMakeLists, so switched off by a project include) are not built: 74 compile units instead of 178
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DCMAKE_PROJECT_llama.cpp_INCLUDE=$(abspath $(VENV))/no-common.cmake

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	echo 'set(LLAMA_BUILD_COMMON OFF)' > $(VENV)/no-common.cmake
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install -q --no-binary llama-cpp-python -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: install
	HF_HUB_OFFLINE=1 $(BIN)/specdec demo

test: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "not slow" tests

# The suite as on a CPU without native bf16 (AVX2 only), whatever this CPU has.
test-restricted: install
	SPECDEC_NO_NATIVE_BF16=1 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 HF_HUB_OFFLINE=1 \
		$(BIN)/python -m pytest -q -m "not slow" tests

# Integration tests that build a peer's tools first (llama-server from llama.cpp's source; cached after)
test-slow: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m slow tests

bench: install
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/bench_runner.py

clean:
	rm -rf $(VENV) build *.egg-info
