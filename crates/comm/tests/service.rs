//! The communication service in whole jobs on 127.0.0.1: coordinator, colocated and CPU
//! summation servers, and workers as threads.

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use sumflow_comm::trace::TraceConfig;
use sumflow_comm::{
    CommConfig, CommError, CommunicationService, Compression, Declaration, Exchange, ReduceOp,
    WireBytes,
};
use sumflow_plan::partition::WHOLE_TENSOR_BYTES;
use sumflow_plan::scheduler::SchedulerKind;
use sumflow_wire::{Codec, Dtype, ErrorCode, KeyCodec, KeyInit, Message, PushMode};

mod common;
use common::*;

#[test]
fn workers_sum_and_average_through_colocated_and_cpu_servers() {
    // n = 3, k = 1: two lanes to the CPU server, each of its partitions cut in two; the
    // partition size changes twice on the way.
    let workers = 3;
    run_job(workers, 1, move |w, addr| {
        let c = worker(addr, w);
        assert_eq!(
            (c.rank(), c.size(), c.local_rank(), c.local_size()),
            (w, 3, 0, 1)
        );
        // A model's parameters as a group, then tensors declared alone in an
        // order that differs per worker.
        let group: Vec<(String, u64)> = (0..12)
            .map(|i| (format!("layer{i}.weight"), 100 + 700 * i))
            .collect();
        let specs: Vec<(&str, Dtype, u64)> = group
            .iter()
            .map(|(n, e)| (n.as_str(), Dtype::F32, *e))
            .collect();
        let mut ids = c.declare_group(&specs).unwrap();
        let mut extra: Vec<u32> = (0..4).collect();
        extra.rotate_left(w as usize);
        let mut extra_ids = vec![0; 4];
        for e in extra {
            extra_ids[e as usize] = c
                .declare(&format!("extra{e}"), Dtype::F32, 3000 + u64::from(e))
                .unwrap();
        }
        ids.extend(extra_ids);
        let sizes: Vec<u64> = group
            .iter()
            .map(|g| g.1)
            .chain((0..4).map(|e| 3000 + e))
            .collect();
        assert!(
            c.placement_report().len() >= 3,
            "{:?}",
            c.placement_report()
        );
        for round in 1..=5u64 {
            // The auto-tuner's switch, made by every worker between the same two
            // rounds: a new partition size re-cuts everything under new keys, and
            // going back to the first one reuses its keys.
            match round {
                3 => {
                    c.reconfigure(Some(1000), Some(3000)).unwrap();
                    let s = c.schedule();
                    assert_eq!((s.partition_bytes, s.credit_bytes), (1000, 3000));
                }
                5 => c.reconfigure(Some(4096), None).unwrap(),
                _ => {}
            }
            let op = if round == 2 {
                ReduceOp::Sum
            } else {
                ReduceOp::Average
            };
            let mut data: Vec<Vec<f32>> = sizes
                .iter()
                .enumerate()
                .map(|(t, &n)| {
                    (0..n)
                        .map(|i| (i as usize % 97 + t) as f32 * (w + 1) as f32)
                        .collect()
                })
                .collect();
            sum_all(&c, &ids, &mut data, op);
            for (t, d) in data.iter().enumerate() {
                for (i, v) in d.iter().enumerate() {
                    let base = (i % 97 + t) as f32;
                    let sum = base * (1 + 2 + 3) as f32;
                    let want = if op == ReduceOp::Sum { sum } else { sum / 3.0 };
                    assert_eq!(*v, want, "worker {w} round {round} tensor {t} element {i}");
                }
            }
        }
        c.barrier(Duration::from_secs(10)).unwrap();
        c.shutdown("done").unwrap();
    });
}

/// Asynchronous training (BytePS §4.3) through the whole pipeline: partitions on
/// colocated and CPU servers, stored values starting from the initial value, each
/// worker's deltas added at once; under staleness 0 every worker's round r returns a
/// value with every worker's first r deltas in it (and the latest: others may have pushed
/// their next round by then).
#[test]
fn deltas_reach_the_stored_value_through_every_partition() {
    let workers = 3;
    run_job(workers, 1, move |w, addr| {
        let c = worker(addr, w);
        c.reconfigure(Some(1024), None).unwrap();
        let elements = 2000usize; // 8 partitions of 256 elements (the last shorter)
        let free = c.declare("free", Dtype::I32, elements as u64).unwrap();
        let bounded = c.declare("bounded", Dtype::I32, elements as u64).unwrap();
        let mut initial: Vec<i32> = (0..elements as i32).collect();
        let push = |id: u32, delta: &mut Vec<i32>, initial: &mut Vec<i32>, staleness| {
            // SAFETY: both buffers outlive the wait below, untouched meanwhile.
            let h = unsafe {
                c.push_delta(
                    id,
                    (delta.as_mut_ptr().cast(), elements * 4),
                    initial.as_mut_ptr().cast(),
                    staleness,
                    0,
                )
            }
            .unwrap();
            c.wait(h, Duration::from_secs(20)).unwrap();
        };
        // Unbounded: each worker sees its own deltas, and whatever others' came first.
        for round in 1..=3 {
            let mut delta = vec![1 << w; elements];
            push(free, &mut delta, &mut initial, None);
            for (i, v) in delta.iter().enumerate() {
                let own = (i as i32) + round * (1 << w);
                assert!(*v >= own && *v <= i as i32 + 3 * 7, "{w} {round} {i}: {v}");
            }
        }
        // Staleness 0: a worker's round r holds every worker's first r deltas, and at most
        // the others' round r + 1 (which they may push once their own round r is answered).
        for round in 1..=3 {
            let mut delta = vec![1 << w; elements];
            push(bounded, &mut delta, &mut initial, Some(0));
            for (i, v) in delta.iter().enumerate() {
                let least = i as i32 + round * 7;
                let most = least + 7 - (1 << w);
                assert!(
                    (least..=most).contains(v),
                    "worker {w} round {round} element {i}: {v} not in {least}..={most}"
                );
            }
        }
        // Deltas are raw elements of every worker.
        let squeezed = c
            .declare_one(&compressed(
                "squeezed",
                elements as u64,
                ("sign", 0.0, false),
            ))
            .unwrap();
        let mut delta = vec![0; elements];
        // SAFETY: refused before anything is read; both buffers outlive the call.
        let e = unsafe {
            c.push_delta(
                squeezed,
                (delta.as_mut_ptr().cast(), elements * 4),
                initial.as_mut_ptr().cast(),
                None,
                0,
            )
        }
        .unwrap_err();
        assert!(
            e.to_string().contains("deltas are added as raw elements"),
            "{e}"
        );
        c.barrier(Duration::from_secs(20)).unwrap();
        c.shutdown("done").unwrap();
    });
}

fn compressed<'a>(name: &'a str, elements: u64, how: (&str, f64, bool)) -> Declaration<'a> {
    Declaration {
        name,
        dtype: Dtype::F32,
        elements,
        compression: Some(Compression::parse(how.0, how.1, how.2).unwrap()),
        members: None,
        home: None,
        shape: None,
    }
}

fn of_members<'a>(name: &'a str, elements: u64, members: &'a [u32]) -> Declaration<'a> {
    Declaration {
        members: Some(members),
        ..Declaration::raw(name, Dtype::F32, elements)
    }
}

#[test]
fn a_tensor_of_some_workers_is_summed_and_averaged_over_them_alone() {
    // n = 3, k = 1: the member tensor's partitions spread over every server and lane.
    run_job(3, 1, move |w, addr| {
        let c = worker(addr, w);
        // Refused before the coordinator hears of them.
        for (members, says) in [
            (&[][..], "has an empty member list"),
            (&[0, 2, 2], "lists worker 2 twice"),
            (&[2, 0], "out of order"),
            (
                &[0, 3],
                "names worker 3 among its members, but this job has workers 0..3",
            ),
        ] {
            let e = c.declare_one(&of_members("bad", 10, members)).unwrap_err();
            assert!(matches!(e, CommError::Invalid(_)), "{e}");
            assert!(
                e.to_string().contains("tensor 'bad'") && e.to_string().contains(says),
                "{e}"
            );
        }
        let e = c
            .declare_one(&Declaration {
                members: Some(&[0]),
                ..compressed("bad", 10, ("sign", 0.0, false))
            })
            .unwrap_err();
        assert!(e.to_string().contains("must be uncompressed"), "{e}");
        let e = c
            .declare_one(&Declaration {
                shape: Some(&[3, 3]),
                ..Declaration::raw("bad", Dtype::F32, 10)
            })
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("is declared with 10 elements but shape [3, 3]"),
            "{e}"
        );

        let elements = 3000; // three partitions of 4 KiB
        let ids = c
            .declare_groups(&[
                of_members("pair", elements, &[0, 2]),
                Declaration::raw("all", Dtype::F32, elements),
            ])
            .unwrap();
        let value = |i: usize| (w as usize * 10 + i % 7) as f32;
        let mut data: Vec<Vec<f32>> = (0..2).map(|_| (0..3000).map(value).collect()).collect();
        if w == 1 {
            // Not a member: refused here, before the server would count it gone.
            // SAFETY: refused, the call keeps no pointer to `data`.
            let e = unsafe {
                c.push_pull(
                    ids[0],
                    data[0].as_mut_ptr().cast(),
                    3000 * 4,
                    0,
                    ReduceOp::Sum,
                )
            }
            .unwrap_err();
            assert!(
                e.to_string()
                    .contains("summed over workers [0, 2]: worker 1 is not one"),
                "{e}"
            );
            sum_all(&c, &ids[1..], &mut data[1..], ReduceOp::Average);
        } else {
            sum_all(&c, &ids, &mut data, ReduceOp::Average);
            for (i, v) in data[0].iter().enumerate() {
                // The mean of workers 0 and 2: (i % 7 + 20 + i % 7) / 2.
                assert_eq!(*v, (i % 7) as f32 + 10.0, "pair element {i}");
            }
            // A second round of the member tensor alone.
            let mut again = vec![w as f32; 3000];
            sum_all(
                &c,
                &ids[..1],
                std::slice::from_mut(&mut again),
                ReduceOp::Sum,
            );
            assert!(again.iter().all(|&v| v == 2.0));
        }
        for (i, v) in data[1].iter().enumerate() {
            assert_eq!(*v, (i % 7) as f32 + 10.0, "all element {i}");
        }
        c.barrier(Duration::from_secs(10)).unwrap();
        c.shutdown("done").unwrap();
    });
}

#[test]
fn workers_naming_different_members_are_stopped_with_both_lists_named() {
    run_job(2, 0, move |w, addr| {
        let c = worker(addr, w);
        c.barrier(Duration::from_secs(10)).unwrap();
        let members: &[u32] = if w == 0 { &[0, 1] } else { &[1] };
        let mut data = vec![1f32; 100];
        let err = match c.declare_one(&of_members("ps.weight", 100, members)) {
            Err(e) => e,
            Ok(id) => {
                let deadline = std::time::Instant::now() + Duration::from_secs(10);
                loop {
                    // SAFETY: waited on below before `data` is dropped.
                    match unsafe {
                        c.push_pull(id, data.as_mut_ptr().cast(), 400, 0, ReduceOp::Sum)
                    } {
                        Err(e) => break e,
                        Ok(h) => {
                            let _ = c.wait(h, Duration::from_millis(200));
                        }
                    }
                    assert!(
                        std::time::Instant::now() < deadline,
                        "mismatch never reported"
                    );
                }
            }
        };
        assert_eq!(err.code(), ErrorCode::KeyMismatch, "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("'ps.weight' declared as f32 x 100 summed over workers [")
                && msg.contains("summed over workers [0, 1] by worker 0")
                && msg.contains("summed over workers [1] by worker 1")
                && msg.contains("same dtype, size, shape, compression and members"),
            "{msg}"
        );
        drop(c);
    });
}

#[test]
fn compressed_tensors_sum_exactly_where_their_codecs_lose_nothing() {
    // Inputs each codec carries without loss, through colocated servers and a CPU server
    // (whose partitions are cut into a piece per lane), with a partition size change:
    // - top-k keeping half, of tensors nonzero at even elements only;
    // - random-k keeping everything;
    // - sign, of elements of one magnitude whose signs agree across workers;
    // - dithering, of elements that are 0 or the norm.
    let n = 3001u64;
    run_job(2, 1, move |w, addr| {
        let c = worker(addr, w);
        let decls = [
            compressed("topk", n, ("topk", 0.5, true)),
            compressed("randomk", n, ("randomk", 1.0, false)),
            compressed("sign", n, ("sign", 0.0, true)),
            compressed("dithering", n, ("dithering", 3.0, false)),
        ];
        let ids = c.declare_groups(&decls).unwrap();
        // Each worker's elements, and their average, where `scale` is 1 and 2 (so 1.5).
        let pattern = |i: u64, scale: f32| -> [f32; 4] {
            let s = if i.is_multiple_of(3) { -1.0 } else { 1.0 };
            let ramp = (i % 89) as f32 * scale;
            [
                if i.is_multiple_of(2) { ramp } else { 0.0 },
                ramp,
                s * 4.0,
                if i.is_multiple_of(5) { 0.0 } else { s * 8.0 },
            ]
        };
        let inputs = |i: u64| pattern(i, (w + 1) as f32);
        let wants = |i: u64| pattern(i, 1.5);
        for round in 1..=3 {
            if round == 3 {
                c.reconfigure(Some(2048), None).unwrap();
            }
            let mut data: Vec<Vec<f32>> = (0..4)
                .map(|t| (0..n).map(|i| inputs(i)[t]).collect())
                .collect();
            sum_all(&c, &ids, &mut data, ReduceOp::Average);
            for (t, d) in data.iter().enumerate() {
                for (i, v) in d.iter().enumerate() {
                    let want = wants(i as u64)[t];
                    assert_eq!(*v, want, "{} round {round} element {i}", decls[t].name);
                }
            }
        }
        // Sign sends a bit per element (and a scale per piece), not four bytes.
        let (keys, _) = c.wire_bytes();
        let sent = |tensor: &str| -> u64 {
            keys.iter()
                .filter(|k| &*k.tensor == tensor)
                .map(|k| k.bytes.sent)
                .sum()
        };
        let dense = 3 * n * 4;
        assert!(sent("sign") < dense / 8, "{} of {dense}", sent("sign"));
        c.barrier(Duration::from_secs(10)).unwrap();
        c.shutdown("done").unwrap();
    });
}

#[test]
fn error_feedback_delivers_everything_a_sparse_codec_held_back() {
    // Each worker sends its tensor once, then zeros: top-k keeps a tenth per round, on the
    // workers and again on the servers, so the rest arrives over later rounds from the
    // residuals; random-k's residual does the same for the elements it has not drawn.
    // An element crosses two random-k draws of 1/4 (worker, then server), so it is still
    // held back after r rounds with probability about r/4 · (3/4)^(r-1): at 45 rounds one
    // of the 2500 in five layouts missed; at 90, one in 10^6 jobs.
    let n = 2500u64;
    run_job(2, 1, move |w, addr| {
        let c = worker(addr, w);
        let decls = [
            compressed("topk", n, ("topk", 0.1, true)),
            compressed("randomk", n, ("randomk", 0.25, true)),
        ];
        let ids = c.declare_groups(&decls).unwrap();
        let input = |i: u64| ((i * 7 + u64::from(w) * 13) % 101) as f32;
        let mut total = vec![vec![0f64; n as usize]; 2];
        for round in 0..90 {
            let mut data: Vec<Vec<f32>> = (0..2)
                .map(|_| {
                    (0..n)
                        .map(|i| if round == 0 { input(i) } else { 0.0 })
                        .collect()
                })
                .collect();
            sum_all(&c, &ids, &mut data, ReduceOp::Sum);
            for (t, d) in data.iter().enumerate() {
                if round == 0 {
                    let sent = d.iter().filter(|v| **v != 0.0).count() as u64;
                    assert!(
                        sent < n / 2,
                        "{}: {sent} elements in round 0",
                        decls[t].name
                    );
                }
                for (acc, v) in total[t].iter_mut().zip(d) {
                    *acc += f64::from(*v);
                }
            }
        }
        for (t, tot) in total.iter().enumerate() {
            for (i, v) in tot.iter().enumerate() {
                let i = i as u64;
                let want = ((i * 7) % 101 + (i * 7 + 13) % 101) as f64;
                assert_eq!(*v, want, "{} element {i}", decls[t].name);
            }
        }
        c.barrier(Duration::from_secs(10)).unwrap();
        c.shutdown("done").unwrap();
    });
}

#[test]
fn workers_compressing_a_tensor_differently_are_stopped_with_both_compressions_named() {
    run_job(2, 0, move |w, addr| {
        let c = worker(addr, w);
        c.barrier(Duration::from_secs(10)).unwrap();
        let how = if w == 0 {
            ("topk", 0.01, true)
        } else {
            ("sign", 0.0, false)
        };
        // Whichever declaration comes second is refused; the other worker learns it from
        // its next operation.
        let mut data = vec![1f32; 5000];
        let err = match c.declare_one(&compressed("fc.weight", 5000, how)) {
            Err(e) => e,
            // SAFETY: `data` outlives the wait on the handle.
            Ok(id) => match unsafe {
                c.push_pull(id, data.as_mut_ptr().cast(), 5000 * 4, 0, ReduceOp::Sum)
            } {
                // The refusal may have arrived already.
                Err(e) => e,
                Ok(h) => c.wait(h, Duration::from_secs(20)).unwrap_err(),
            },
        };
        let msg = err.to_string();
        assert!(
            msg.contains("'fc.weight' declared as f32 x 5000 compressed by")
                && msg.contains("topk (ratio 0.01) with error feedback by worker 0")
                && msg.contains("compressed by sign by worker 1"),
            "{msg}"
        );
        drop(c);
    });
}

#[test]
fn a_declaration_mismatch_stops_every_worker_with_its_name() {
    run_job(2, 0, move |w, addr| {
        let c = worker(addr, w);
        c.barrier(Duration::from_secs(10)).unwrap();
        // Worker 1 has the wrong size for 'fc.weight'.
        let declared = c.declare("fc.weight", Dtype::F32, 1000 + u64::from(w) * 24);
        let err = match declared {
            Err(e) => e,
            Ok(id) => {
                let elements = 1000 + w as usize * 24;
                let mut data = vec![0f32; elements];
                // The other worker's declaration breaks the job: wait for it to land.
                let deadline = std::time::Instant::now() + Duration::from_secs(10);
                loop {
                    // SAFETY: waited on below before `data` is dropped.
                    match unsafe {
                        c.push_pull(id, data.as_mut_ptr().cast(), elements * 4, 0, ReduceOp::Sum)
                    } {
                        Err(e) => break e,
                        Ok(h) => {
                            let _ = c.wait(h, Duration::from_millis(200));
                        }
                    }
                    assert!(
                        std::time::Instant::now() < deadline,
                        "mismatch never reported"
                    );
                }
            }
        };
        let msg = err.to_string();
        assert!(
            msg.contains("fc.weight") && msg.contains("f32 x 1024") && msg.contains("f32 x 1000"),
            "{msg}"
        );
        drop(c);
    });
}

#[test]
fn a_crashed_worker_fails_the_others_operations_by_name() {
    let job = job(2, 1);
    let addr = job.addr.clone();
    let victim = {
        let addr = addr.clone();
        thread::spawn(move || {
            let c = worker(&addr, 1);
            c.declare("w", Dtype::F32, 5000).unwrap();
            c
        })
    };
    let c = worker(&addr, 0);
    let id = c.declare("w", Dtype::F32, 5000).unwrap();
    let crashed = victim.join().unwrap();
    let mut data = vec![1f32; 5000];
    let h = push_pull(&c, id, &mut data, 0, ReduceOp::Sum);
    // Worker 1 dies without leaving, before pushing its share.
    drop(crashed);
    let err = c.wait(h, Duration::from_secs(10)).unwrap_err();
    assert_eq!(err.code(), ErrorCode::NodeFailed, "{err}");
    assert!(err.to_string().contains("trainer 1"), "{err}");
    assert!(!matches!(err, CommError::Timeout { .. }));
    drop(c);
    finish(job);
}

#[test]
fn without_a_set_size_each_declaration_derives_its_own_and_the_credit_follows() {
    // n = 2, k = 0: 2 servers. A 6 MiB group: 6 MiB / (2 x 32) = 96 KiB, raised to the
    // 256 KiB floor; a 24 MiB tensor alone: 384 KiB, so 256 KiB. The tuner's explicit size
    // then wins.
    run_job(2, 0, move |w, addr| {
        let mut cfg = config(addr, w);
        cfg.partition_bytes = None;
        let c = CommunicationService::start(cfg).unwrap();
        let before = c.schedule();
        assert!(before.derived);
        assert_eq!(
            (before.partition_bytes, before.credit_bytes),
            (4 << 20, 8 << 20)
        );
        let mib = 1u64 << 20;
        let ids = c
            .declare_group(&[("a", Dtype::F32, mib), ("b", Dtype::F32, mib / 2)])
            .unwrap();
        let after = c.schedule();
        assert_eq!(
            (after.partition_bytes, after.credit_bytes),
            (256 << 10, 512 << 10)
        );
        let big = c.declare("big", Dtype::F32, 6 * mib).unwrap();
        for round in 0..2 {
            if round == 1 {
                c.reconfigure(Some(1 << 20), None).unwrap();
                let s = c.schedule();
                assert!(!s.derived);
                assert_eq!(s.partition_bytes, 1 << 20);
            }
            let sizes = [mib, mib / 2, 6 * mib];
            let mut data: Vec<Vec<f32>> = sizes
                .iter()
                .map(|&n| (0..n).map(|i| (i % 251) as f32 + w as f32).collect())
                .collect();
            sum_all(&c, &[ids[0], ids[1], big], &mut data, ReduceOp::Sum);
            for (t, d) in data.iter().enumerate() {
                for (i, v) in d.iter().enumerate() {
                    let want = 2.0 * (i % 251) as f32 + 1.0;
                    assert_eq!(*v, want, "worker {w} round {round} tensor {t} element {i}");
                }
            }
        }
        // The keys each tensor went by: the derived layout's, then the 1 MiB one's.
        let (keys, _) = c.wire_bytes();
        let count = |name: &str| keys.iter().filter(|k| &*k.tensor == name).count();
        assert_eq!(
            (count("a"), count("b"), count("big")),
            (16 + 4, 8 + 2, 96 + 24)
        );
        c.barrier(Duration::from_secs(10)).unwrap();
        c.shutdown("done").unwrap();
    });
}

#[test]
fn fifo_sends_whole_tensors() {
    // Two colocated servers: cut into 4 KiB partitions, two tensors of 120 kB and 20 kB
    // would be spread half and half; whole, each sits on one server.
    run_job(2, 0, move |w, addr| {
        let mut cfg = config(addr, w);
        cfg.scheduler = SchedulerKind::Fifo;
        let c = CommunicationService::start(cfg).unwrap();
        let s = c.schedule();
        assert_eq!(
            (s.scheduler, s.partition_bytes),
            (SchedulerKind::Fifo, WHOLE_TENSOR_BYTES)
        );
        let ids = c
            .declare_group(&[("big", Dtype::F32, 30_000), ("small", Dtype::F32, 5_000)])
            .unwrap();
        assert_eq!(
            c.placement_report(),
            [
                "server 0: 0.1 MB, 85.7% of declared bytes",
                "server 1: 0.0 MB, 14.3% of declared bytes"
            ]
        );
        let err = c.reconfigure(Some(8192), None).unwrap_err();
        assert!(
            err.to_string()
                .contains("the fifo scheduler sends whole tensors"),
            "{err}"
        );
        let mut big: Vec<f32> = (0..30_000).map(|i| (i % 7 + w as usize) as f32).collect();
        let mut small = vec![w as f32 + 1.0; 5_000];
        let h1 = push_pull(&c, ids[0], &mut big, 0, ReduceOp::Sum);
        let h2 = push_pull(&c, ids[1], &mut small, 1, ReduceOp::Sum);
        c.wait(h1, Duration::from_secs(20)).unwrap();
        c.wait(h2, Duration::from_secs(20)).unwrap();
        for (i, v) in big.iter().enumerate() {
            assert_eq!(*v, (2 * (i % 7) + 1) as f32, "element {i}");
        }
        assert!(small.iter().all(|&v| v == 3.0));
        c.barrier(Duration::from_secs(10)).unwrap();
        c.shutdown("done").unwrap();
    });
}

#[test]
fn wire_accounting_counts_every_frame_per_key() {
    // Every frame's length, from the protocol's own encoder: the counts must equal what
    // the frames of three rounds add up to, headers and acknowledgements included.
    let frame = |m: Message, payload: usize| (m.encode(payload).len() + payload) as u64;
    let (key, round) = (0, 0);
    let init = frame(
        Message::InitKey {
            key,
            dtype: Dtype::F32,
            byte_len: 0,
            init: KeyInit::Zeros,
            codec: KeyCodec::RAW,
        },
        0,
    );
    let push = frame(
        Message::Push {
            key,
            round,
            dtype: Dtype::F32,
            codec: Codec::Raw,
            mode: PushMode::Sum,
            op: sumflow_wire::ReduceOp::Sum,
        },
        0,
    );
    let pull = frame(
        Message::Pull {
            key,
            round,
            wants_sum: true,
        },
        0,
    );
    let init_ack = frame(Message::InitAck { key }, 0);
    let push_ack = frame(Message::PushAck { key, round }, 0);
    let reply = frame(
        Message::PullReply {
            key,
            round,
            dtype: Dtype::F32,
            codec: Codec::Raw,
        },
        0,
    );
    let leave = frame(
        Message::Shutdown {
            reason: "done".into(),
        },
        0,
    );
    run_job(2, 0, move |w, addr| {
        let c = worker(addr, w);
        let id = c.declare("grads", Dtype::F32, 3000).unwrap();
        let rounds = 3;
        let mut data = vec![1.0f32; 3000];
        for _ in 0..rounds {
            let h = push_pull(&c, id, &mut data, 0, ReduceOp::Sum);
            c.wait(h, Duration::from_secs(20)).unwrap();
        }
        c.barrier(Duration::from_secs(10)).unwrap();
        let (keys, other) = c.wire_bytes();
        let parts = keys.len() as u64;
        assert!(parts >= 3, "12000 bytes in 4096-byte partitions: {keys:?}");
        assert!(keys.iter().all(|k| &*k.tensor == "grads"));
        let sent: u64 = keys.iter().map(|k| k.bytes.sent).sum();
        let received: u64 = keys.iter().map(|k| k.bytes.received).sum();
        let payload = rounds * 12_000;
        assert_eq!(
            sent,
            parts * init + rounds * parts * (push + pull) + payload
        );
        assert_eq!(
            received,
            parts * init_ack + rounds * parts * (push_ack + reply) + payload
        );
        assert_eq!(other, WireBytes::default(), "nothing but the tensor yet");
        c.shutdown("done").unwrap();
        let (_, other) = c.wire_bytes();
        assert_eq!(other.sent, 2 * leave, "one Shutdown per server connection");
    });
}

#[test]
fn a_trace_directory_that_cannot_be_made_is_an_io_error_and_a_bad_window_an_invalid_argument() {
    // Both are checked before joining: no coordinator needed.
    let dir = std::env::temp_dir().join(format!("sumflow-trace-io-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("file");
    std::fs::write(&file, "").unwrap();
    let start = |trace: TraceConfig| {
        let mut cfg = CommConfig::new("127.0.0.1:1", token(), "h");
        cfg.trace = Some(trace);
        CommunicationService::start(cfg).expect_err("refused")
    };
    let e = start(TraceConfig::new(file.join("sub")));
    assert!(matches!(e, CommError::Io { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.starts_with(&format!(
            "cannot create the trace directory {}",
            file.join("sub").display()
        )),
        "{msg}"
    );
    let e = start(TraceConfig {
        steps: 0,
        ..TraceConfig::new(&dir)
    });
    assert!(matches!(e, CommError::Invalid(_)), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_joined_worker_counts_as_zeros_until_every_worker_joined() {
    let lasts = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = Arc::clone(&lasts);
    run_job(3, 1, move |rank, addr| {
        let c = worker(addr, rank);
        let id = c.declare("x", Dtype::F32, 5000).unwrap();
        let mine = |r: u32| vec![r as f32 + 1.0; 5000];
        let mut d = mine(rank);
        let h = push_pull(&c, id, &mut d, 0, ReduceOp::Sum);
        c.wait(h, Duration::from_secs(20)).unwrap();
        assert_eq!(d[0], 6.0);
        let last = if rank == 2 {
            c.join(Duration::from_secs(20)).unwrap()
        } else {
            // Worker 2 counts as zeros; Average still divides by 3.
            let mut d = mine(rank);
            let h = push_pull(&c, id, &mut d, 0, ReduceOp::Sum);
            c.wait(h, Duration::from_secs(20)).unwrap();
            assert_eq!((d[0], d[4999]), (3.0, 3.0), "worker {rank}");
            let mut d = mine(rank);
            let h = push_pull(&c, id, &mut d, 0, ReduceOp::Average);
            c.wait(h, Duration::from_secs(20)).unwrap();
            assert_eq!(d[0], 1.0, "worker {rank}");
            c.join(Duration::from_secs(20)).unwrap()
        };
        seen.lock().unwrap().push(last);
        // Back in step: worker 2's next round of "x" is the others' next one.
        let mut d = mine(rank);
        let h = push_pull(&c, id, &mut d, 0, ReduceOp::Sum);
        c.wait(h, Duration::from_secs(20)).unwrap();
        assert_eq!(d[0], 6.0, "worker {rank} after the join");
        c.shutdown("done").unwrap();
    });
    let lasts = lasts.lock().unwrap();
    assert_eq!(lasts.len(), 3);
    assert!(lasts.iter().all(|&l| l == lasts[0] && l != 2), "{lasts:?}");
}

#[test]
fn a_retired_tensor_frees_its_keys_and_its_name_and_in_flight_ones_are_refused() {
    let job = job(2, 1);
    let threads: Vec<_> = (0..2u32)
        .map(|w| {
            let addr = job.addr.clone();
            thread::spawn(move || {
                let c = worker(&addr, w);
                // 3000 f32 in 4 KiB partitions: three keys.
                let old = c.declare("t", Dtype::F32, 3000).unwrap();
                let mut data = vec![1.0f32; 3000];
                if w == 0 {
                    let h = push_pull(&c, old, &mut data, 0, ReduceOp::Sum);
                    // Worker 1 pushes only after the barrier: the operation is in flight.
                    let e = c.retire(old).unwrap_err();
                    assert!(e.to_string().contains("in flight"), "{e}");
                    c.barrier(Duration::from_secs(10)).unwrap();
                    c.wait(h, Duration::from_secs(20)).unwrap();
                } else {
                    c.barrier(Duration::from_secs(10)).unwrap();
                    let h = push_pull(&c, old, &mut data, 0, ReduceOp::Sum);
                    c.wait(h, Duration::from_secs(20)).unwrap();
                }
                assert!(data.iter().all(|v| *v == 2.0));
                assert_eq!(c.live_tensors(), 1);
                c.retire(old).unwrap();
                assert_eq!(c.live_tensors(), 0);
                let e = c.retire(old).unwrap_err();
                assert!(e.to_string().contains("already retired"), "{e}");
                // SAFETY: refused before anything is queued.
                let e =
                    unsafe { c.push_pull(old, data.as_mut_ptr().cast(), 12000, 0, ReduceOp::Sum) }
                        .unwrap_err();
                assert!(e.to_string().contains("never declared"), "{e}");
                // The name again, in another layout: a new tensor with a new id, answered
                // once both workers retired the old one.
                let new = c.declare("t", Dtype::F32, 10).unwrap();
                assert_ne!(new, old);
                let mut small = vec![w as f32; 10];
                let h = push_pull(&c, new, &mut small, 0, ReduceOp::Sum);
                c.wait(h, Duration::from_secs(20)).unwrap();
                assert!(small.iter().all(|v| *v == 1.0));
                c.shutdown("done").unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    // Every server saw the workers' frames in order: the old tensor's keys (at least
    // three partitions, a CPU server's cut into a piece per lane) are freed, and the new
    // one's (one partition, maybe in pieces) live.
    let servers = job.servers.join().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (live, freed) = servers.iter().fold((0, 0), |(l, f), s| {
            let (live, _, freed) = s.key_counts();
            (l + live, f + freed)
        });
        if freed >= 3 && (1..=2).contains(&live) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "live {live}, freed {freed}"
        );
        thread::sleep(Duration::from_millis(10));
    }
    for s in servers {
        s.shutdown();
        s.wait();
    }
    job.coordinator.shutdown();
    let _ = job.coordinator.wait();
}

#[test]
fn an_exchange_pushes_and_takes_back_only_the_partitions_of_its_ranges() {
    // 3000 f32 in 4 KiB partitions: three keys. Worker 0 contributes only the first
    // partition (skipping the others' rounds); worker 1 takes back only the first.
    run_job(2, 0, move |w, addr| {
        let c = worker(addr, w);
        let id = c.declare("x", Dtype::F32, 3000).unwrap();
        let mut d = vec![w as f32 + 1.0; 3000];
        let first_bytes = std::iter::once(0..100).collect::<Vec<_>>();
        let (pushes, pulls) = match w {
            0 => (Some(first_bytes), None),
            _ => (None, Some(first_bytes)),
        };
        let exchange = Exchange { pushes, pulls };
        let before = c
            .wire_bytes()
            .0
            .iter()
            .map(|k| k.bytes.received)
            .sum::<u64>();
        // SAFETY: waited on before `d` is touched again.
        let h = unsafe {
            c.push_exchange(
                id,
                (d.as_mut_ptr().cast(), 12000),
                0,
                ReduceOp::Sum,
                &exchange,
            )
        }
        .unwrap();
        c.wait(h, Duration::from_secs(20)).unwrap();
        let received = c
            .wire_bytes()
            .0
            .iter()
            .map(|k| k.bytes.received)
            .sum::<u64>()
            - before;
        let first = 4096 / 4;
        // The first partition holds both workers' values; the others only worker 1's.
        assert!(d[..first].iter().all(|v| *v == 3.0), "worker {w}");
        assert!(d[first..].iter().all(|v| *v == 2.0), "worker {w}");
        if w == 1 {
            // One partition's sum and two notices (and acknowledgements), not three sums.
            assert!((4096..6000).contains(&received), "{received} bytes");
        }
        // A range outside the tensor is refused before anything is sent.
        let bad = Exchange {
            pushes: Some(std::iter::once(0..12001).collect()),
            pulls: None,
        };
        // SAFETY: refused before anything is queued.
        let e =
            unsafe { c.push_exchange(id, (d.as_mut_ptr().cast(), 12000), 0, ReduceOp::Sum, &bad) }
                .unwrap_err();
        assert!(
            e.to_string().contains("outside the tensor's 12000 bytes"),
            "{e}"
        );
        c.shutdown("done").unwrap();
    });
}
