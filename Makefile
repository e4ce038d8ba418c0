# Shortcuts; scripts/ holds the real work. Every target sets up what it needs.
.PHONY: test run bench-cluster bench-cluster-quick bench-schedulers bench-schedulers-quick bench-grid

# Formatting, lints, every test (what CI runs).
test:
	bash scripts/test.sh

# A local job: 4 workers + 2 CPU servers train the digits example.
run:
	bash scripts/run-local.sh

# The emulated-cluster benchmark's standard configuration (needs root; about 10 minutes):
# n = 4 worker hosts, k = 0..4 CPU-server hosts, 250 Mbit/s links, goodput and training on
# the VGG-16, ResNet-50 and Transformer profiles. Results in bench/results/cluster/.
bench-cluster:
	bash scripts/bench-cluster.sh

# The same harness in about a minute: 2 hosts, small sizes (a check that it works here).
bench-cluster-quick:
	bash scripts/bench-cluster.sh --workers 2 --cpu-servers 0,1 --megabytes 4 --rounds 2 \
	    --models resnet50 --iterations 5 --out bench/results/cluster-quick

# Issue 6's scheduler benchmark (needs root; about an hour): n = 4 workers, VGG-16, ResNet-50
# and Transformer at 1, 2, 5 and 10 Gbit/s (scaled), sumflow's schedulers (across the global
# barrier) and DDP/gloo side by side per cell; the targets' verdicts at the end.
# Results in bench/results/schedulers/.
SCHEDULERS = fifo,p3,bytescheduler,bytescheduler-tuned,prophet,ddp
bench-schedulers:
	bash scripts/bench-cluster.sh --skip-goodput --schedulers $(SCHEDULERS) \
	    --reference-gbits 1,2,5,10 --iterations 20 --warmup-iterations 3 \
	    --out bench/results/schedulers

# The same in a few minutes: 2 workers, VGG-16 at 1 Gbit/s only, few iterations.
bench-schedulers-quick:
	bash scripts/bench-cluster.sh --skip-goodput --schedulers $(SCHEDULERS) --workers 2 \
	    --models vgg16 --reference-gbits 1 --iterations 5 \
	    --warmup-iterations 1 --out bench/results/schedulers-quick

# The grid search the auto-tuner is judged against (about 15 minutes): bytescheduler on
# VGG-16 at 10 Gbit/s with 4 CPU-server hosts over 6 partition sizes x 5 credits, as in
# BENCHMARKS.md (the tracked bench/results/grid/GRID.json is the grid it shows; this writes
# a new one beside it). Then:
#   python -m sumflow_bench.tune_compare bench/results/grid-new/GRID.json
bench-grid:
	bash scripts/bench-cluster.sh --skip-goodput --grid bench/results/grid-new/GRID.json \
	    --reference-gbits 10 --scheduler-k 4 --iterations 10 --warmup-iterations 2 \
	    --out bench/results/grid-new
