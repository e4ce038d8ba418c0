"""Benchmarks that reproduce sumflow's claims on one Linux machine.

- :mod:`sumflow.bench.netns`: an emulated cluster, hosts as network namespaces behind a
  switch, every link shaped with tc;
- :mod:`sumflow.bench.theory`: the communication times of BytePS §2 and §4.1 (Table 1,
  Eq. 1, 2, 6, 7), the optimum lines of the plots;
- :mod:`sumflow.bench.cluster`: the harness, ``python -m sumflow.bench.cluster`` (goodput
  against the optimum and gloo, training on layer profiles), with JSON, markdown and PNG
  output;
- worker programs it starts on the emulated hosts: :mod:`sumflow.bench.goodput_worker`,
  :mod:`sumflow.bench.train_worker`.

See docs/benchmarks.md.
"""
