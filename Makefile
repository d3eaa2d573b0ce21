# The README's commands. Each target does its own set-up on a fresh machine.
#   make serve  the main job: set up, fetch the default model, warm, serve it on 127.0.0.1:8000
#   make test   set up, fetch the default model, ruff + the book + pytest + the notebooks under nbval
#   make chat   chat with the default model in the terminal
#   make book   the course as a static site in build/site (book/build.py; executes nothing)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup model serve chat generate test lint book unit notebooks-test notebooks bench lmeval clean

setup: $(STAMP)

# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

model: setup
	$(BIN)/nanoserve fetch-model

# ARGS passes options through, e.g. make serve ARGS="--port 9000 --api-key secret"
serve: model
	$(BIN)/nanoserve serve $(ARGS)

chat: model
	$(BIN)/nanoserve chat

generate: model
	$(BIN)/nanoserve generate "Write a haiku about paged memory."

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check nanoserve tests days

unit: model
	$(BIN)/python -m pytest tests/ -q; rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

# Notebooks run under nbval against their committed outputs; running them must not change
# any tracked file (under test they render their diagrams into a temporary folder).
# CPU_KIND=avx2|avx512|avx512_vnni runs them as that kind of CPU would, on a CPU that has at
# least its instructions: torch's kernels (ATEN_CPU_CAPABILITY), oneDNN's (ONEDNN_MAX_CPU_ISA)
# and nanoserve's native kernels (NANOSERVE_ISA, built for that ISA) all held to it. Run it for
# each kind below this machine's before committing outputs, e.g. make notebooks-test CPU_KIND=avx2
CPU_KIND ?= native
EMULATE_avx2 := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 NANOSERVE_ISA=avx2
EMULATE_avx512 := ATEN_CPU_CAPABILITY=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE NANOSERVE_ISA=avx512
EMULATE_avx512_vnni := ATEN_CPU_CAPABILITY=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 NANOSERVE_ISA=avx512_vnni
EMULATE_native :=
EMULATE = $(if $(filter $(CPU_KIND),native avx2 avx512 avx512_vnni),$(EMULATE_$(CPU_KIND)),$(error CPU_KIND is one of native avx2 avx512 avx512_vnni, not $(CPU_KIND)))

notebooks-test: model
	@before=$$(git status --porcelain --untracked-files=all | sha1sum); \
	$(EMULATE) $(BIN)/python -m pytest --nbval notebooks/ --nbval-sanitize-with notebooks/sanitize.cfg -q -p no:cacheprovider; rc=$$?; \
	[ $$rc -eq 5 ] && rc=0; \
	after=$$(git status --porcelain --untracked-files=all | sha1sum); \
	if [ "$$before" != "$$after" ]; then echo "running the notebooks changed the tree:"; git status --short; exit 1; fi; \
	exit $$rc

# The course as a book: book/build.py lays the executed notebooks and the journal out as pages
# under build/book and runs `mkdocs build --strict`, which fails on a broken link or a missing
# page. MkDocs + Material because a notebook converted to Markdown is then one page with its
# journal entry, and strict validation checks every link of it (mkdocs-jupyter renders
# notebooks outside Markdown, where no link is checked).
book: setup
	$(BIN)/python book/build.py

# lm-evaluation-harness through the server against its own hf backend (evals/check.py)
lmeval: model
	$(BIN)/python -m pip install -q -e '.[dev,eval]'
	$(BIN)/python evals/check.py

test: lint book unit notebooks-test

# Re-sync every notebook from its .py source and execute it in place (writes diagrams/).
notebooks: model
	cd notebooks && for py in day*.py; do \
		../$(BIN)/jupytext --sync "$$py" && \
		NANOSERVE_WRITE_DIAGRAMS=1 ../$(BIN)/jupyter nbconvert --to notebook --execute --inplace \
			--ExecutePreprocessor.timeout=600 "$${py%.py}.ipynb" || exit 1; \
	done

bench: model
	$(BIN)/python -m nanoserve.bench decode
	$(BIN)/python -m nanoserve.bench throughput
	$(BIN)/python -m nanoserve.bench serve

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
