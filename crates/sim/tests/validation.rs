//! The simulator against BytePS's formulas, and its refusals. Python's
//! `python/tests/test_sim.py` covers the scheduling papers' examples.

use serde_json::{json, Value};
use sumflow_sim::{simulate, SimConfig, SimError};

/// 1 GB/s links, nothing but bandwidth, every gradient ready at once, one iteration.
fn communication(arch: &str, n: u32, k: u32, tensors: usize, bytes: u64, partition: u64) -> Value {
    let mut cfg: Value = serde_json::from_str(include_str!("tiny.json")).unwrap();
    cfg["model"]["layers"] = json!([{
        "name": "set", "forward_s": 0.0, "backward_s": 0.0,
        "tensors": (0..tensors).map(|i| json!({"name": format!("t{i}"), "bytes": bytes})).collect::<Vec<_>>(),
    }]);
    cfg["cluster"] = json!({"machines": n, "gpus_per_machine": 1, "cpu_machines": k});
    cfg["network"] = json!({
        "bandwidth": 1e9, "cpu_bandwidth": 1e9, "latency_s": 0.0, "message_overhead_s": 0.0,
        "intra_bandwidth": 1e11, "segment_bytes": 4096, "nic_queue_bytes": 0, "header_bytes": 0,
    });
    cfg["architecture"] = json!(arch);
    cfg["schedule"]["partition_bytes"] = json!(partition);
    cfg["schedule"]["credit_bytes"] = Value::Null;
    cfg["schedule"]["window_bytes"] = Value::Null;
    cfg["training"]["cross_barrier"] = json!(false);
    cfg["training"]["warmup_iterations"] = json!(0);
    cfg["training"]["iterations"] = json!(1);
    cfg
}

fn run(cfg: &Value) -> Result<sumflow_sim::Report, SimError> {
    let cfg: SimConfig = serde_json::from_value(cfg.clone()).expect("a well-formed configuration");
    simulate(&cfg, &mut |_| {})
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1e-12)
}

#[test]
fn ring_allreduce_is_table_1_exactly() {
    for n in [2u32, 4, 6] {
        let m = 12.0 * 196_608.0 * 8.0;
        let r = run(&communication("ring", n, 0, 12, 196_608 * 8, 196_608)).unwrap();
        let t = 2.0 * f64::from(n - 1) * m / (f64::from(n) * 1e9);
        assert!(
            close(r.iteration_s, t),
            "n = {n}: {} against {t}",
            r.iteration_s
        );
    }
}

#[test]
fn byteps_busiest_link_is_eq_6_exactly() {
    // n^2 + kn - 2k equal partitions, so Eq. 1 and 2 place whole partitions.
    for (n, k) in [(4u32, 2u32), (5, 3), (3, 3)] {
        let units = n * n + k * n - 2 * k;
        let part = 65_536u64;
        let (nf, kf) = (f64::from(n), f64::from(k));
        let m = f64::from(units) * part as f64;
        let eq6 = 2.0 * nf * (nf - 1.0) * m / ((nf * nf + kf * nf - 2.0 * kf) * 1e9);
        // Switch ports in arrival order or in turn: the links carry the same bytes.
        for fair in [false, true] {
            let mut cfg = communication("byteps", n, k, units as usize, part, part);
            cfg["network"]["fair_downlinks"] = json!(fair);
            let r = run(&cfg).unwrap();
            assert!(
                close(r.network_s, eq6),
                "n = {n}, k = {k}, fair {fair}: {} against {eq6}",
                r.network_s
            );
            assert!(r.iteration_s >= eq6);
        }
    }
}

#[test]
fn folded_and_unfolded_workers_agree() {
    let mut cfg = communication("ps", 4, 2, 40, 262_144, 65_536);
    cfg["model"]["layers"][0]["forward_s"] = json!(0.002);
    cfg["model"]["layers"][0]["backward_s"] = json!(0.004);
    cfg["training"]["cross_barrier"] = json!(true);
    cfg["training"]["warmup_iterations"] = json!(2);
    cfg["training"]["iterations"] = json!(2);
    let folded = run(&cfg).unwrap();
    cfg["exploit_symmetry"] = json!(false);
    let full = run(&cfg).unwrap();
    assert_eq!(folded.machines.len(), 3);
    assert_eq!(full.machines.len(), 6);
    let rel = (folded.iteration_s / full.iteration_s - 1.0).abs();
    assert!(
        rel < 0.005,
        "{} against {}",
        folded.iteration_s,
        full.iteration_s
    );
}

#[test]
fn compute_jitter_makes_every_round_wait_for_the_slowest_machine() {
    // Compute dominates: an iteration is the slowest machine's compute plus a little.
    let mut cfg = communication("ps", 4, 2, 8, 4096, 4096);
    cfg["model"]["layers"][0]["forward_s"] = json!(0.02);
    cfg["model"]["layers"][0]["backward_s"] = json!(0.04);
    cfg["training"]["warmup_iterations"] = json!(1);
    cfg["training"]["iterations"] = json!(40);
    let steady = run(&cfg).unwrap();
    cfg["training"]["compute_jitter"] = json!(0.3);
    cfg["seed"] = json!(11);
    let jittered = run(&cfg).unwrap();
    // Folding identical machines would be wrong now: every one is simulated.
    assert_eq!(steady.machines.len(), 3);
    assert_eq!(jittered.machines.len(), 6);
    // Each machine's factor has mean 1, the slowest of four does not.
    assert!(
        jittered.iteration_s > 1.15 * steady.iteration_s,
        "{} against {}",
        jittered.iteration_s,
        steady.iteration_s
    );
    let spread = |r: &sumflow_sim::Report| {
        let (lo, hi) = r
            .iterations_s
            .iter()
            .fold((f64::MAX, 0.0f64), |(lo, hi), &t| (lo.min(t), hi.max(t)));
        hi / lo
    };
    assert!((spread(&steady) - 1.0).abs() < 1e-9);
    assert!(spread(&jittered) > 1.2);
    // A seed repeats its draws; another seed draws others.
    assert_eq!(run(&cfg).unwrap().iterations_s, jittered.iterations_s);
    cfg["seed"] = json!(12);
    assert_ne!(run(&cfg).unwrap().iterations_s, jittered.iterations_s);
}

#[test]
fn refusals_name_the_field_and_the_way_out() {
    let mut base = communication("ring", 2, 0, 2, 4096, 4096);
    // Optional in the JSON form (0: none); present here so that they can be replaced.
    base["training"]["compute_jitter"] = json!(0.0);
    base["network"]["nic_queue_spread"] = json!(0.0);
    // (JSON pointer, new value, what the refusal must say)
    let cases = [
        ("/cluster/cpu_machines", json!(1), "choose 'byteps'"),
        ("/architecture", json!("ps"), "cluster.cpu_machines is 0"),
        ("/cluster/machines", json!(0), "cluster.machines"),
        ("/network/bandwidth", json!(0.0), "network.bandwidth"),
        (
            "/schedule/scheduler",
            json!("lifo"),
            "unknown scheduler 'lifo'",
        ),
        ("/training/iterations", json!(0), "training.iterations"),
        (
            "/training/compute_jitter",
            json!(1.5),
            "training.compute_jitter",
        ),
        (
            "/network/nic_queue_spread",
            json!(-0.5),
            "network.nic_queue_spread",
        ),
        (
            "/model/layers/0/tensors/0/bytes",
            json!(6),
            "tensor 't0' has 6 bytes",
        ),
        (
            "/schedule/priorities",
            json!([1]),
            "one priority per tensor",
        ),
    ];
    for (pointer, value, words) in cases {
        let mut cfg = base.clone();
        *cfg.pointer_mut(pointer).expect(pointer) = value;
        let err = run(&cfg).expect_err(words).to_string();
        assert!(err.contains(words), "{err:?} should say {words:?}");
    }
    let mut cfg = base.clone();
    cfg["network"]["jitter"] = json!(1);
    let err = serde_json::from_value::<SimConfig>(cfg)
        .unwrap_err()
        .to_string();
    assert!(err.contains("jitter"), "{err}");
}
