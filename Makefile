# vllm-gfx936: the maintainer's day, as make targets. `make help` lists them.
# Patch-stack targets need only python3 (>= 3.11) and git; build/test targets make .venv.

SHELL      := /bin/bash
PYTHON     ?= python3
VENV       ?= .venv
VPY        := $(VENV)/bin/python
STACK      := $(PYTHON) -m tools.stack
FLAVOUR    ?= python
TORCH      ?= 2.13.0
PYTEST_ARGS ?=
BUILD_DEPS := "setuptools>=77.0.3,<81" setuptools-scm setuptools-rust wheel packaging cmake ninja jinja2
TEST_DEPS  := pytest triton==3.9.0 ray==2.60.0

.DEFAULT_GOAL := help
.PHONY: help no-rocm upstream apply unapply status refresh new edit check series-stats wheel venv install oracle info demo test \
        test-tooling e2e step-audit tiny-model tiny-mtp rebase rebase-accept bench bench-stage bench-layer bench-ab ab-stage device-check kernels kernel-check kernel-doc clean

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## /  make \1\t/' | expand -t 24

# ---- patch stack -----------------------------------------------------------------------------
upstream: ## put pristine pinned upstream in vllm/ (submodule, else verified PyPI sdist)
	$(STACK) upstream
apply: upstream ## apply patches/series to vllm/, one commit per patch, zero fuzz, fail closed
	$(STACK) apply
unapply: ## return vllm/ to pristine upstream (FORCE=1 drops unrefreshed commits to a backup ref)
	$(STACK) unapply $(if $(FORCE),--force)
status: ## which patches are applied, in sync or modified
	$(STACK) status
edit: ## stop at patch PATCH=<name> in vllm/ to change it (then amend, continue, make refresh)
	@test -n "$(PATCH)" || { echo "usage: make edit PATCH=<name>" >&2; exit 2; }
	$(STACK) edit $(PATCH)
new: ## start patch NAME=<slug> on top of the series
	@test -n "$(NAME)" || { echo "usage: make new NAME=<slug>" >&2; exit 2; }
	$(STACK) new $(NAME)
refresh: ## write vllm/'s patch commits back to patches/ (idempotent)
	$(STACK) refresh
check: upstream ## lint series + headers, zero-fuzz apply to pristine, gitlink pin, changelog
	$(STACK) check
series-stats: ## per patch: lines, hunk lines in upstream's files vs new files, net gfx936: markers (REV=<commit>)
	$(PYTHON) -m tools.series_stats $(if $(REV),--rev $(REV))
rebase: upstream ## carry the series onto UPSTREAM=<version|commit>; writes a report, never touches patches/
	@test -n "$(UPSTREAM)" || { echo "usage: make rebase UPSTREAM=<version|commit>" >&2; exit 2; }
	$(STACK) rebase $(UPSTREAM) $(if $(RUN_TESTS),--run-tests --test-python $(VPY))
rebase-accept: upstream ## adopt build/rebase-UPSTREAM/: pin, gitlink, patches/, CHANGELOG entry, in one step
	@test -n "$(UPSTREAM)" || { echo "usage: make rebase-accept UPSTREAM=<version|commit>" >&2; exit 2; }
	$(STACK) rebase-accept $(UPSTREAM)
REBASE_VERSIONS ?= 0.28.0 0.34.0
REBASE_TESTS_TIMEOUT ?= 300
rebase-reports: upstream ## regenerate the committed docs/rebase-<X>.md for REBASE_VERSIONS (default 0.28.0 0.34.0), patch tests run
	$(STACK) rebase-reports $(REBASE_VERSIONS) --run-tests --test-python $(VPY) --tests-timeout $(REBASE_TESTS_TIMEOUT)

# ---- build and install ----------------------------------------------------------------------
$(VPY):
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==$(TORCH) $(BUILD_DEPS) $(TEST_DEPS)
venv: $(VPY) ## make .venv: torch (CPU build), build and test tools

# .venv holds a CPU torch: the rocm flavour is built by ./build.sh in the venv with DTK's torch.
NOT_ROCM = @if [ "$(FLAVOUR)" = rocm ]; then echo "make: FLAVOUR=rocm is built by ./build.sh in the \
venv that holds DTK's torch (then python -m tools.site_install dist/<wheel>), not in .venv" >&2; exit 2; fi
no-rocm:
	$(NOT_ROCM)

wheel: no-rocm $(VPY) upstream ## build the fork's wheel into dist/ (FLAVOUR=python|cpu; rocm: ./build.sh)
	$(VPY) -m tools.stack wheel --flavour $(FLAVOUR)

install: no-rocm $(VPY) upstream ## build the wheel (FLAVOUR) and install it with vLLM's deps into .venv
	set -o pipefail; whl="$$($(VPY) -m tools.stack wheel --flavour $(FLAVOUR) | tail -1)" && \
	  $(VPY) -m pip install -q --force-reinstall --no-deps "$$whl" && $(VPY) -m pip install -q "$$whl"

info: ## show what the installed fork is (version, upstream, patches)
	$(VPY) -m vllm.gfx936 info

DEMO_VENV  ?= .venv-demo
demo: $(VPY) upstream ## newcomer's main command: the fork's CPU wheel serves a tiny model via `vllm serve`
	@mkdir -p build; echo "==> make wheel FLAVOUR=cpu (log: build/demo-wheel.log)"; \
	if ! $(VPY) -m tools.stack wheel --flavour cpu > build/demo-wheel.log; then \
	  tail -40 build/demo-wheel.log; exit 1; fi; \
	$(PYTHON) -m tools.stack.demo --wheel "$$(tail -1 build/demo-wheel.log)" --venv $(DEMO_VENV) \
	  --torch "torch==$(TORCH)"

# ---- tests ----------------------------------------------------------------------------------
ORACLE_TRANSFORMERS ?= 5.25.0
oracle: $(VPY) ## transformers (ORACLE_TRANSFORMERS, 5.25.0) for the DeepSeek V4 oracle (tests/e2e), in .venv after vLLM
	@# --no-deps: its `kernels` pin needs Python >= 3.12; vLLM accepts it (transformers >= 5.5.3), but
	@# `pip install vllm` picks an older transformers, so this runs after `make install`.
	$(VPY) -m pip install -q --no-deps transformers==$(ORACLE_TRANSFORMERS)
	$(VPY) -m pip install -q "huggingface_hub>=2.4.0,<3.0" tokenizers safetensors regex pyyaml tqdm typer accelerate

TRAIN_DEVICE ?= cpu
tiny-model: $(VPY) ## re-train models/dsv4-tiny-gpl3 on the GPL-3 text (TRAIN_DEVICE=cuda: minutes; cpu: hours)
	$(VPY) -m tools.dsv4_train prepare --work build/dsv4-train
	$(VPY) -m tools.dsv4_train train --work build/dsv4-train --device $(TRAIN_DEVICE) --steps 2900
	$(VPY) -m tools.dsv4_train export --work build/dsv4-train --out models/dsv4-tiny-gpl3
	$(MAKE) tiny-mtp

tiny-mtp: $(VPY) ## train models/dsv4-tiny-gpl3's MTP layer, main model frozen (CPU, ~8 min); rewrites only mtp.*
	nice -n 10 $(VPY) -m tools.dsv4_mtp_train --model models/dsv4-tiny-gpl3 \
		--samples 40 --held-out 4 --steps 400 --time-limit 420

# A skipped test fails `make test` / `make e2e` and names what was missing (tests/required_skips.py);
# tests that cannot run on a CPU machine are marked may_skip(reason=...) and counted. REQUIRE_ALL= relaxes it.
REQUIRE_ALL ?= --require-all
test: check install oracle ## run make check, then the whole CPU test suite (what CI runs; a skip fails it)
	$(VPY) -m pytest -q tests $(REQUIRE_ALL) $(PYTEST_ARGS)
e2e: check install oracle ## DeepSeek V4 on the CPU through the real engine (CPU wheel, LLM + serve) vs transformers
	$(VPY) -m pytest -q tests/e2e $(REQUIRE_ALL) $(PYTEST_ARGS)
STEP_AUDIT_JSON ?= build/step-audit.json
step-audit: check install ## launches and host syncs per DeepSeek V4 layer kind in decode steps (CPU engine; table + JSON)
	STEP_AUDIT_JSON=$(STEP_AUDIT_JSON) $(VPY) -m pytest -q -s tests/e2e/test_dsv4_step_audit.py $(PYTEST_ARGS)
test-tooling: $(VPY) ## patch-stack engine tests only (fast, no vLLM install needed)
	$(VPY) -m pytest -q tests/tooling $(PYTEST_ARGS)

# ---- benchmarks (GPU; on a CPU-only machine they stage .device/ and say how to run them) ----
BENCH_PY   ?= python3
BENCH_ARGS ?=
DENSE_MOE_ARGS ?=
KERNELS_ARGS ?=
MHC_ARGS   ?=
LAYER_ARGS ?=
# the csrc_gfx936 library of `make kernels`, timed/checked when it exists
KERNEL_LIB_ARG = $(if $(wildcard build/kernels/_gfx936_C.so),--kernel-lib build/kernels/_gfx936_C.so)
BENCH_GPU  := $(BENCH_PY) -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null
bench-stage: ## copy the leaf files the benches import out of vllm/ into .device/ (stdlib only)
	$(PYTHON) bench/stage.py
bench: bench-stage ## Sparse MLA decode, dense W8A16, MXFP4 MoE, fused mHC (+ csrc_gfx936 kernels and the layer step after make kernels) (GPU)
	@if $(BENCH_GPU); then $(BENCH_PY) bench/sparse_mla_decode.py $(KERNEL_LIB_ARG) $(BENCH_ARGS) && \
	  $(BENCH_PY) bench/dense_moe.py $(DENSE_MOE_ARGS) && \
	  $(BENCH_PY) bench/mhc_fused.py $(MHC_ARGS) && \
	  if [ -n "$(KERNEL_LIB_ARG)" ]; then $(BENCH_PY) bench/gfx936_kernels.py $(KERNEL_LIB_ARG) \
	    $(KERNELS_ARGS) && $(BENCH_PY) bench/layer_step.py $(KERNEL_LIB_ARG) $(LAYER_ARGS); else echo "bench: no build/kernels/_gfx936_C.so: run make kernels for the part 2 kernels"; fi; else \
	  echo "bench: no CUDA/ROCm GPU visible to $(BENCH_PY); .device/sparse_mla is staged."; \
	  echo "  on a GPU machine with torch + triton, in a copy of this repo that has .device/:"; \
	  echo "    make bench BENCH_ARGS='--out sparse-mla-decode.md'   (BENCH_PY=<python with torch>)"; \
	  echo "  lent H200 (run tool): command 'make bench device-check', carry ['.device']"; \
	  echo "  CPU smoke of the code: $(BENCH_PY) bench/sparse_mla_decode.py --smoke"; \
	  echo "  dense W8A16 + MXFP4 MoE: DENSE_MOE_ARGS='--out dense-moe.md'; smoke: bench/dense_moe.py --smoke"; \
	  echo "  csrc_gfx936 part 2 kernels (after make kernels): KERNELS_ARGS='--out kernels.md'"; \
	  echo "  fused mHC vs the torch chain: MHC_ARGS='--out mhc.md'; smoke: bench/mhc_fused.py --smoke"; \
	  echo "  one decoder layer's decode step, eager + graph (after make kernels): LAYER_ARGS='--out layer.md'; smoke: bench/layer_step.py --smoke"; fi
# the layer step alone (issue 19 item 6): builds the kernels, then every layer kind (SWA, C128, C4) at
# TP8 and TP4, batch 1/16/64, eager and graph on rotating inputs; about 4-6 min on the H200
# (lent H200, run tool: command 'make bench-layer LAYER_ARGS="--out $$OUT/layer-step-h200.md"',
# carry ['.device'] after make bench-stage here)
bench-layer: bench-stage ## one decoder layer's decode step per kind through the fork's ops, eager + graph, rotating inputs (GPU)
	@if $(BENCH_GPU); then $(KERNEL_PY) csrc_gfx936/build.py --out build/kernels && \
	  $(BENCH_PY) bench/layer_step.py --kernel-lib build/kernels/_gfx936_C.so $(LAYER_ARGS); else \
	  echo "bench-layer: no CUDA/ROCm GPU visible to $(BENCH_PY); .device/layer is staged."; \
	  echo "  lent H200 (run tool): command 'make bench-layer LAYER_ARGS=\"--out \$$OUT/layer-step-h200.md\"', carry ['.device']"; \
	  echo "  CPU smoke of the code: TRITON_INTERPRET=1 $(BENCH_PY) bench/layer_step.py --smoke"; fi
# A/B of a kernel change in one run (issue 21: ratios from one run, not across leases): here,
# `make ab-stage BASE=<rev>` puts that revision's csrc_gfx936/ into .device/base/; on the GPU
# machine (run tool, carry ['.device']) `make bench-ab AB_ARGS="--out $$OUT/ab.md"` builds both
# and times them alternately (bench/kernel_ab.py: Sparse MLA, MoE and dense decode back to back,
# the prefill dequants)
BASE ?=
AB_ARGS ?=
ab-stage: bench-stage ## put csrc_gfx936/ of BASE=<rev> into .device/base/ for make bench-ab
	@test -n "$(BASE)" || { echo "ab-stage: name the base revision: make ab-stage BASE=<commit|tag>"; exit 2; }
	@git rev-parse --verify -q "$(BASE)^{commit}" >/dev/null || { echo "ab-stage: BASE=$(BASE) is not a commit of this repo"; exit 2; }
	rm -rf .device/base && mkdir -p .device/base
	git archive "$(BASE)" csrc_gfx936 | tar -x -C .device/base
	git rev-parse "$(BASE)" > .device/base/REVISION
	@echo "ab-stage: .device/base/csrc_gfx936 = $(BASE) ($$(cat .device/base/REVISION)); on the GPU machine: make bench-ab"
bench-ab: ## time the kernels of .device/base (make ab-stage) against the working tree's, alternately (GPU)
	@test -f .device/base/csrc_gfx936/build.py || { echo "bench-ab: no .device/base/csrc_gfx936: run make ab-stage BASE=<rev> first (where git is), carry .device"; exit 2; }
	@if $(BENCH_GPU); then $(KERNEL_PY) csrc_gfx936/build.py --out build/kernels & p1=$$!; \
	  $(KERNEL_PY) .device/base/csrc_gfx936/build.py --out build/kernels_base & p2=$$!; \
	  wait $$p1 && wait $$p2 && $(BENCH_PY) bench/kernel_ab.py --base-lib build/kernels_base/_gfx936_C.so \
	    --lib build/kernels/_gfx936_C.so $(AB_ARGS); else \
	  echo "bench-ab: no CUDA/ROCm GPU visible to $(BENCH_PY); .device/base holds $$(cat .device/base/REVISION)"; fi
device-check: bench-stage ## numerics vs float64: Sparse MLA decode, dense W8A16, MXFP4 MoE, kernels (GPU)
	@if $(BENCH_GPU); then rc=0; $(BENCH_PY) bench/device_check.py $(KERNEL_LIB_ARG) $(BENCH_ARGS) || rc=1; \
	  $(BENCH_PY) bench/dense_moe.py --no-speed $(DENSE_MOE_ARGS) || rc=1; \
	  if [ -n "$(KERNEL_LIB_ARG)" ]; then $(BENCH_PY) bench/gfx936_kernels.py --no-speed \
	    $(KERNEL_LIB_ARG) $(KERNELS_ARGS) || rc=1; fi; exit $$rc; else \
	  echo "device-check: no CUDA/ROCm GPU visible to $(BENCH_PY); .device/sparse_mla is staged."; \
	  echo "  on a GPU machine: make device-check   (exits 1 on a numerics mismatch)"; \
	  echo "  CPU smoke of the code: $(BENCH_PY) bench/device_check.py --smoke"; \
	  echo "  dense W8A16 + MXFP4 MoE numerics: $(BENCH_PY) bench/dense_moe.py --smoke --no-speed"; fi

# ---- csrc_gfx936 kernels --------------------------------------------------------------------
KERNEL_PY  ?= $(BENCH_PY)
KERNEL_ARCH ?= gfx90a
kernels: ## build torch.ops._gfx936_C (csrc_gfx936) with ninja for this torch: ROCm (PYTORCH_ROCM_ARCH) or CUDA
	$(KERNEL_PY) csrc_gfx936/build.py --out build/kernels $(if $(INTO),--into $(INTO))
kernel-check: ## AMD compile check (KERNEL_ARCH): per-kernel register/scratch/LDS/occupancy table in build/kernel-check; fails on scratch, AGPRs, v_mfma
	csrc_gfx936/compile_check.sh --arch $(KERNEL_ARCH) --out build/kernel-check

kernel-doc: ## after a kernel change: make kernel-check (gfx90a), then rewrite docs/kernel-resources.md's two tables from it
	$(MAKE) kernel-check KERNEL_ARCH=gfx90a
	$(PYTHON) -c 'import sys; from pathlib import Path; sys.path.insert(0, "csrc_gfx936"); \
	  import resource_report as R; \
	  R.rewrite_doc(Path("docs/kernel-resources.md"), Path("build/kernel-check/resources.gfx90a.json"))'

clean: ## remove build outputs (keeps vllm/ and the download cache)
	rm -rf build dist
