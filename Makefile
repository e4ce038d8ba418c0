# Shortcuts; scripts/ holds the real work. Every target sets up what it needs.
.PHONY: test run bench-cluster bench-cluster-quick

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
