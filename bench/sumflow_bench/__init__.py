"""sumflow's benchmarks and lab tools: what reproduces sumflow's claims on one Linux
machine, kept out of the library's wheel (the emulated cluster needs root).

- :mod:`sumflow_bench.netns`: an emulated cluster, hosts as network namespaces behind a
  switch, every link shaped with tc;
- :mod:`sumflow_bench.theory`: the communication times of BytePS §2 and §4.1 (Table 1,
  Eq. 1, 2, 6, 7), the optimum lines of the plots;
- :mod:`sumflow_bench.cluster`: the harness, ``python -m sumflow_bench.cluster`` (goodput
  against the optimum and gloo, training on layer profiles), with JSON, markdown and PNG
  output;
- worker programs it starts on the emulated hosts: :mod:`sumflow_bench.goodput_worker`,
  :mod:`sumflow_bench.train_worker` (the sleeping model of :mod:`sumflow_bench.model`, on
  profiles scaled by :mod:`sumflow_bench.scaling`);
- :mod:`sumflow_bench.fusion`: fused against unfused gradients on loopback;
- :mod:`sumflow_bench.pushpull_vs_gloo`: push_pull against gloo's all_reduce;
- :mod:`sumflow_bench.calibrate`: the recorded runs replayed in the simulator;
- :mod:`sumflow_bench.tune_compare`: the tuner's methods compared offline, on a measured
  grid or the step-time model of :mod:`sumflow.tune.synthetic`.

See docs/benchmarks.md.
"""
