# The two commands: `make demo` and `make test`. Each installs what it needs into .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The `bench` extra (matplotlib, nvidia-resiliency-ext) on top: bench-recovery, bench and bench-plots need it.
BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: demo test test-slow unit integration install clean lint docs

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch: the package asks for a range; constraints.txt pins the CPU wheel this machine carries.
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/trainguard demo $(DEMO_ARGS)

# The whole suite but the minutes-long soak and benchmark smoke (marked slow): `make test-slow` runs those.
# The Slurm tests run beside the rest, in a pytest of their own (infra/suite.py).
test: lint
	$(BIN)/python -m infra.suite $(PYTEST_ARGS)

# ruff and mypy, as pyproject.toml configures them; first in `make test` (seconds; mypy caches in .mypy_cache).
LINT_PATHS := workflows activities workers trainguard
lint: $(STAMP)
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/mypy $(LINT_PATHS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest tests -m slow $(PYTEST_ARGS)

unit: $(STAMP)
	$(BIN)/python -m pytest tests -m "not integration" $(PYTEST_ARGS)

integration: $(STAMP)
	$(BIN)/python -m pytest tests -m "integration and not slow" $(PYTEST_ARGS)

# The docs site under site/ (mkdocs, strict: a broken link, a missing anchor or a page left out of the nav fails).
# The spec, CLI and environment-variable references are generated from the code first (trainguard/spec.py, the
# CLI's parser, trainguard/environment.py); the performance tables come from the committed docs/results/*.json.
docs: $(STAMP)
	$(BIN)/python -m infra.docgen.spec_reference
	$(BIN)/python -m infra.docgen.cli_reference
	$(BIN)/python -m infra.docgen.env_reference
	$(BIN)/python -m mkdocs build --strict $(DOCS_ARGS)

# Debian's Slurm 22.05 (slurmctld, slurmd, munge, the client commands) for `trainguard dev up --slurm` and the
# Slurm integration tests (tests/integration/test_slurm.py, skipped without it). Needs root; nothing is started.
SLURM_PACKAGES := slurm-wlm slurmctld slurmd munge slurm-client
.PHONY: slurm-install
slurm-install:
	command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
		&& command -v sbatch >/dev/null || { apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(SLURM_PACKAGES); }

clean:
	-$(BIN)/trainguard dev down
	rm -rf .trainguard .pytest-stack .pytest-tmp site

.PHONY: bench-checkpoint
bench-checkpoint: $(STAMP)
	$(BIN)/python -m infra.bench.checkpoint $(BENCH_ARGS)

# Recovery against torchrun and NVIDIA's ft_launcher in the same run: it installs the `bench` extra
# (nvidia-resiliency-ext) first, so ft_launcher is never skipped as not installed.
.PHONY: bench-recovery
bench-recovery: $(BENCH_STAMP)
	$(BIN)/python -m infra.bench.recovery $(BENCH_ARGS)
	$(BIN)/python -m infra.bench.groups $(GROUPS_BENCH_ARGS)

# Replica groups under TorchFT (examples/ft.json): the healthy groups' step gaps while one recovers, and goodput
# with and without groups, in one run (.bench/groups.json). `make bench-recovery` runs it after its own rows.
.PHONY: bench-groups
bench-groups: $(BENCH_STAMP)
	$(BIN)/python -m infra.bench.groups $(GROUPS_BENCH_ARGS)

.PHONY: bench-goodput
bench-goodput: $(STAMP)
	$(BIN)/python -m infra.bench.goodput $(BENCH_ARGS)

.PHONY: bench-scale
bench-scale: $(STAMP)
	$(BIN)/python -m infra.bench.scale $(BENCH_ARGS)

# Node scale: one run of 16 ... 4,096 simulated nodes x 8 ranks on the real workflows, and its Temporal cost
# (events, pending, payloads, relaunch) against issue 12's targets; .bench/nodes.json.
.PHONY: bench-nodes
bench-nodes: $(STAMP)
	$(BIN)/python -m infra.bench.nodes $(BENCH_ARGS)

# The node pool at size: one lease of 4,096 nodes, and 100 runs started at once on stand-in nodes (.bench/pool.json)
.PHONY: bench-pool
bench-pool: $(STAMP)
	$(BIN)/python -m infra.bench.pool $(BENCH_ARGS)

# Hang attribution: 2 nodes x 2 ranks, 20 hangs per mode (stop, python, skip-collective, io) on random ranks
# and 20 fault-free irregular runs (examples/irregular.py): right culprits, detection, time to name the culprit,
# false hangs and stragglers; .bench/attribution.json.
.PHONY: bench-attribution
bench-attribution: $(STAMP)
	$(BIN)/python -m infra.bench.attribution $(BENCH_ARGS)

.PHONY: bench-paths
bench-paths: $(STAMP)
	$(BIN)/python -m infra.bench.paths $(BENCH_ARGS)

.PHONY: soak
soak: $(STAMP)
	$(BIN)/python -m infra.chaos_soak $(SOAK_ARGS)

# Every benchmark, one after the other (never in parallel: they would skew each other), then the pictures
# (.bench/recovery-timeline.png, recovery-lost.png, checkpoint.png). The plots need matplotlib and the
# ft_launcher baseline nvidia-resiliency-ext: the `bench` extra (pip install -e '.[bench]').
$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev,bench]'
	touch $(BENCH_STAMP)

# Copy the benchmarks' .bench/*.json into docs/results/, which the Performance page renders: commit them with a release.
.PHONY: bench-publish
bench-publish: $(STAMP)
	$(BIN)/python -m infra.docgen.performance --publish

.PHONY: bench bench-plots
bench: $(BENCH_STAMP)
	$(BIN)/python -m infra.bench.checkpoint $(CHECKPOINT_BENCH_ARGS)
	$(BIN)/python -m infra.bench.recovery $(RECOVERY_BENCH_ARGS)
	$(BIN)/python -m infra.bench.paths $(PATHS_BENCH_ARGS)
	$(BIN)/python -m infra.bench.goodput $(GOODPUT_BENCH_ARGS)
	$(BIN)/python -m infra.bench.groups $(GROUPS_BENCH_ARGS)
	$(BIN)/python -m infra.bench.scale $(SCALE_BENCH_ARGS)
	$(BIN)/python -m infra.bench.nodes $(NODES_BENCH_ARGS)
	$(BIN)/python -m infra.bench.plots $(PLOTS_ARGS)

bench-plots: $(BENCH_STAMP)
	$(BIN)/python -m infra.bench.plots $(PLOTS_ARGS)
