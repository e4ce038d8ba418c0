//! Tensors whose members share one machine are summed in its shared memory: exact for
//! every dtype and reduction, with no byte sent to a summation server, in any order of
//! operations, with relays, process sets spanning machines, join and a crashed peer.

use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use half::f16;
use sumflow_comm::{CommError, CommunicationService, Declaration, Exchange, ReduceOp};
use sumflow_wire::{Dtype, ErrorCode};

mod common;
use common::*;

/// How two i32 terms of a reduction combine.
type Combine = fn(i32, i32) -> i32;

/// `g` workers on machine "box" (one colocated server) and `cpu` CPU servers.
fn run_box(g: u32, cpu: u32, body: impl Fn(u32, &str) + Send + Sync + 'static) {
    run_on(job_on(&["box".to_string()], g, cpu), g, body);
}

fn on_box(addr: &str, rank: u32) -> CommunicationService {
    CommunicationService::start(config_on(addr, rank, "box")).unwrap()
}

/// Reduces `bytes` as tensor `id` in place and waits.
fn reduce(c: &CommunicationService, id: u32, bytes: &mut [u8], op: ReduceOp, ex: &Exchange) {
    // SAFETY: waited for before `bytes` is touched again.
    let h = unsafe { c.push_exchange(id, (bytes.as_mut_ptr(), bytes.len()), 0, op, ex) }.unwrap();
    c.wait(h, Duration::from_secs(20)).unwrap();
}

/// Reduces the whole f32 tensor `d` as tensor `id` in place and waits.
fn reduce_all(c: &CommunicationService, id: u32, d: &mut [f32], op: ReduceOp) {
    reduce(c, id, bytemuck::cast_slice_mut(d), op, &Exchange::ALL);
}

/// This machine's files of the job, if any are left.
fn files_of(job_id: &str) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.contains(job_id))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn every_dtype_and_reduction_is_exact_and_nothing_goes_to_a_server() {
    for g in 1..=4u32 {
        run_box(g, 0, move |rank, addr| {
            let c = on_box(addr, rank);
            // Sizes around the 64-element slices of the two phases, and not divisible by g.
            for elements in [1usize, 63, 64, 65, 1001, 70_001] {
                let name = format!("i32-{elements}");
                let id = c.declare(&name, Dtype::I32, elements as u64).unwrap();
                let mine = |r: u32| -> Vec<i32> {
                    (0..elements)
                        .map(|i| (i % 97) as i32 * (r as i32 + 1) - 40)
                        .collect()
                };
                let ops: [(ReduceOp, Combine); 4] = [
                    (ReduceOp::Sum, i32::wrapping_add),
                    (ReduceOp::Min, Ord::min),
                    (ReduceOp::Max, Ord::max),
                    (ReduceOp::Product, i32::wrapping_mul),
                ];
                for (op, f) in ops {
                    let mut d = mine(rank);
                    reduce(&c, id, bytemuck::cast_slice_mut(&mut d), op, &Exchange::ALL);
                    let terms: Vec<Vec<i32>> = (0..g).map(mine).collect();
                    let want: Vec<i32> = (0..elements)
                        .map(|i| terms[1..].iter().fold(terms[0][i], |acc, t| f(acc, t[i])))
                        .collect();
                    assert_eq!(d, want, "g={g} {name} {op:?} worker {rank}");
                }
                let id = c
                    .declare(&format!("f32-{elements}"), Dtype::F32, elements as u64)
                    .unwrap();
                let mut d: Vec<f32> = (0..elements)
                    .map(|i| (i % 7) as f32 + rank as f32)
                    .collect();
                reduce_all(&c, id, &mut d, ReduceOp::Average);
                for (i, v) in d.iter().enumerate() {
                    let want = (i % 7) as f32 + (g - 1) as f32 / 2.0;
                    assert!(
                        (v - want).abs() <= 1e-6 * want.abs().max(1.0),
                        "g={g} {i}: {v}"
                    );
                }
                let id = c
                    .declare(&format!("f16-{elements}"), Dtype::F16, elements as u64)
                    .unwrap();
                let mut d: Vec<u16> = (0..elements)
                    .map(|i| f16::from_f32((i % 5) as f32 + rank as f32).to_bits())
                    .collect();
                reduce(
                    &c,
                    id,
                    bytemuck::cast_slice_mut(&mut d),
                    ReduceOp::Sum,
                    &Exchange::ALL,
                );
                for (i, v) in d.iter().enumerate() {
                    let want = (g * (i % 5) as u32 + g * (g - 1) / 2) as f32;
                    assert_eq!(f16::from_bits(*v).to_f32(), want, "g={g} f16 {i}");
                }
            }
            let (keys, other) = c.wire_bytes();
            assert!(keys.is_empty(), "g={g}: {keys:?} {other:?}");
            let job_id = c.cluster_map().job_id.clone();
            c.shutdown("done").unwrap();
            // Every file of the job is gone once its workers have shut down (each one's
            // own are unlinked at the latest by its shutdown).
            if g == 1 {
                assert!(files_of(&job_id).is_empty(), "{:?}", files_of(&job_id));
            }
        });
    }
}

#[test]
fn operations_in_a_different_order_on_each_worker_all_complete() {
    run_box(3, 0, |rank, addr| {
        let c = on_box(addr, rank);
        let ids: Vec<u32> = (0..6)
            .map(|t| c.declare(&format!("t{t}"), Dtype::F32, 10_000 + t).unwrap())
            .collect();
        let mut data: Vec<Vec<f32>> = (0..6).map(|t| vec![1.0; 10_000 + t as usize]).collect();
        for _round in 0..3 {
            data.iter_mut().for_each(|d| d.fill(1.0));
            // Worker r issues the tensors rotated by 2r: no two workers share an order.
            let order: Vec<usize> = (0..6).map(|i| (i + 2 * rank as usize) % 6).collect();
            let mut handles = Vec::new();
            for (t, d) in data.iter_mut().enumerate() {
                handles.push((t, d.as_mut_ptr(), d.len()));
            }
            let hs: Vec<u64> = order
                .iter()
                .map(|&t| {
                    let (_, p, n) = handles[t];
                    // SAFETY: waited for below, before data is touched.
                    unsafe { c.push_pull(ids[t], p.cast(), n * 4, 0, ReduceOp::Sum) }.unwrap()
                })
                .collect();
            for h in hs {
                c.wait(h, Duration::from_secs(20)).unwrap();
            }
            assert!(
                data.iter().all(|d| d.iter().all(|v| *v == 3.0)),
                "worker {rank}"
            );
        }
        c.shutdown("done").unwrap();
    });
}

#[test]
fn rounds_across_machines_in_a_different_order_on_each_worker_all_complete() {
    // Three workers on each of two machines: every round is aggregated inside each
    // machine first. Each tensor is larger than what a worker copies in ahead of its own
    // reduces, and no two workers of a machine issue them in the same order: each must
    // still copy in what the others wait for.
    let machines = vec!["a".to_string(), "b".to_string()];
    let job = job_on(&machines, 6, 1);
    let elements = 5 << 18; // 5 MiB of f32
    run_on(job, 6, move |rank, addr| {
        let mut cfg = config_on(addr, rank, &machines[rank as usize / 3]);
        cfg.partition_bytes = Some(1 << 20);
        let c = CommunicationService::start(cfg).unwrap();
        let ids: Vec<u32> = (0..3)
            .map(|t| c.declare(&format!("t{t}"), Dtype::F32, elements).unwrap())
            .collect();
        let mut data: Vec<Vec<f32>> = (0..3).map(|_| vec![0.0; elements as usize]).collect();
        for round in 0..2 {
            data.iter_mut().for_each(|d| d.fill(rank as f32 + 1.0));
            let first = (rank as usize + round) % 3;
            let mut hs = Vec::new();
            for t in (0..3).map(|i| (i + first) % 3) {
                hs.push(push_pull(&c, ids[t], &mut data[t], 0, ReduceOp::Sum));
            }
            for h in hs {
                c.wait(h, Duration::from_secs(20)).unwrap();
            }
            assert!(
                data.iter().all(|d| d.iter().all(|v| *v == 21.0)),
                "worker {rank}, round {round}"
            );
        }
        c.shutdown("done").unwrap();
    });
}

#[test]
fn a_machine_sends_each_partition_once_and_its_other_members_nothing_for_it() {
    // Three workers on each of two machines (BytePS §4.2.2): the member carrying a
    // partition pushes the machine's sum and names the others in `Skips`; they send no
    // frame of that key at all, so a server hears once per machine and partition.
    let machines = vec!["a".to_string(), "b".to_string()];
    let job = job_on(&machines, 6, 1);
    let carried = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = Arc::clone(&carried);
    run_on(job, 6, move |rank, addr| {
        let mut cfg = config_on(addr, rank, &machines[rank as usize / 3]);
        cfg.partition_bytes = Some(1 << 12);
        let c = CommunicationService::start(cfg).unwrap();
        // One partition, which one member per machine carries; and 5 of 4 KiB, carried
        // in runs of whole partitions (2, 2 and 1), not a third of each.
        let small = c.declare("small", Dtype::F32, 10).unwrap();
        let large = c.declare("large", Dtype::F32, 5_000).unwrap();
        for round in 0..3 {
            let mut a = vec![rank as f32 + 1.0; 10];
            let mut b = vec![(round + rank) as f32; 5_000];
            let ha = push_pull(&c, small, &mut a, 0, ReduceOp::Sum);
            let hb = push_pull(&c, large, &mut b, 1, ReduceOp::Sum);
            c.wait(ha, Duration::from_secs(20)).unwrap();
            c.wait(hb, Duration::from_secs(20)).unwrap();
            assert!(a.iter().all(|v| *v == 21.0), "worker {rank}, round {round}");
            let want = (6 * round + 15) as f32;
            assert!(b.iter().all(|v| *v == want), "worker {rank}, round {round}");
        }
        let (keys, _) = c.wire_bytes();
        let mine: Vec<(String, u64)> = keys
            .iter()
            .filter(|k| k.bytes.sent > 0)
            .map(|k| (k.tensor.to_string(), k.key))
            .collect();
        seen.lock().unwrap().push((rank, mine));
        c.shutdown("done").unwrap();
    });
    let carried = carried.lock().unwrap();
    for machine in [0..3u32, 3..6] {
        let of = |tensor: &str| -> Vec<u64> {
            let mut keys: Vec<u64> = carried
                .iter()
                .filter(|(rank, _)| machine.contains(rank))
                .flat_map(|(_, keys)| keys.iter().filter(|(t, _)| t == tensor).map(|k| k.1))
                .collect();
            keys.sort_unstable();
            keys
        };
        let small = of("small");
        assert_eq!(small.len(), 1, "machine of {machine:?}: {carried:?}");
        let large = of("large");
        assert_eq!(large.len(), 5, "machine of {machine:?}: {carried:?}");
        assert!(
            large.windows(2).all(|w| w[0] < w[1]),
            "each key sent by one member"
        );
    }
}

#[test]
fn machines_that_issue_rounds_across_them_in_opposite_orders_complete() {
    // Two workers on each of two machines. Each tensor fills what a worker may have on
    // its way to the summation servers (copied in, not back), and the machines issue
    // them in opposite orders: each holds back the round the other waits for, until the
    // window lets it in for want of any round coming back.
    let machines = vec!["a".to_string(), "b".to_string()];
    let job = job_on(&machines, 4, 1);
    let elements = 4 << 20; // 16 MiB of f32, the window
    run_on(job, 4, move |rank, addr| {
        let mut cfg = config_on(addr, rank, &machines[rank as usize / 2]);
        cfg.partition_bytes = Some(1 << 20);
        let c = CommunicationService::start(cfg).unwrap();
        let ids: Vec<u32> = (0..2)
            .map(|t| c.declare(&format!("t{t}"), Dtype::F32, elements).unwrap())
            .collect();
        let mut data: Vec<Vec<f32>> = (0..2).map(|_| vec![0.0; elements as usize]).collect();
        for round in 0..2 {
            data.iter_mut().for_each(|d| d.fill(rank as f32 + 1.0));
            let order = if rank < 2 { [0, 1] } else { [1, 0] };
            let began = Instant::now();
            let hs: Vec<u64> = order
                .iter()
                .map(|&t| push_pull(&c, ids[t], &mut data[t], 0, ReduceOp::Sum))
                .collect();
            for h in hs {
                c.wait(h, Duration::from_secs(20)).unwrap();
            }
            assert!(
                data.iter().all(|d| d.iter().all(|v| *v == 10.0)),
                "worker {rank}, round {round}"
            );
            // The window opened after its stall time, not after a wait's timeout.
            assert!(
                began.elapsed() < Duration::from_secs(10),
                "{:?}",
                began.elapsed()
            );
        }
        c.shutdown("done").unwrap();
    });
}

#[test]
fn relays_and_shares_take_only_their_ranges() {
    run_box(3, 0, |rank, addr| {
        let c = on_box(addr, rank);
        let id = c.declare("rows", Dtype::I32, 3000).unwrap();
        // Worker 1 holds the rows; the others skip and take rows 1000..2000 only.
        let mut d = vec![-1i32; 3000];
        let ex = if rank == 1 {
            d.iter_mut().enumerate().for_each(|(i, v)| *v = i as i32);
            Exchange {
                pushes: None,
                pulls: Some(vec![]),
            }
        } else {
            Exchange {
                pushes: Some(vec![]),
                // Two overlapping ranges: each byte is taken once.
                pulls: Some(vec![4000..6000, 5000..8000]),
            }
        };
        reduce(&c, id, bytemuck::cast_slice_mut(&mut d), ReduceOp::Sum, &ex);
        for (i, v) in d.iter().enumerate() {
            let took = rank == 1 || (1000..2000).contains(&i);
            let want = if took { i as i32 } else { -1 };
            assert_eq!(*v, want, "worker {rank} element {i}");
        }
        // A round every worker skips sums to zeros.
        let mut d = vec![5i32; 3000];
        let skip = Exchange {
            pushes: Some(vec![]),
            pulls: None,
        };
        reduce(
            &c,
            id,
            bytemuck::cast_slice_mut(&mut d),
            ReduceOp::Sum,
            &skip,
        );
        assert!(d.iter().all(|v| *v == 0), "worker {rank}");
        c.shutdown("done").unwrap();
    });
}

#[test]
fn a_process_set_on_one_machine_uses_its_memory_while_the_job_spans_two() {
    // Workers 0, 1 on machine a; 2, 3 on machine b.
    let machines = vec!["a".to_string(), "b".to_string()];
    let job = job_on(&machines, 4, 0);
    let threads: Vec<_> = (0..4u32)
        .map(|rank| {
            let addr = job.addr.clone();
            let host = machines[rank as usize / 2].clone();
            thread::spawn(move || {
                let c = CommunicationService::start(config_on(&addr, rank, &host)).unwrap();
                let pair: Vec<u32> = if rank < 2 { vec![0, 1] } else { vec![2, 3] };
                let all = c.declare("all", Dtype::F32, 5000).unwrap();
                let local = c
                    .declare_one(&Declaration {
                        members: Some(&pair),
                        ..Declaration::raw(&format!("pair{}", pair[0]), Dtype::F32, 5000)
                    })
                    .unwrap();
                let mut a = vec![rank as f32 + 1.0; 5000];
                reduce_all(&c, all, &mut a, ReduceOp::Sum);
                assert!(a.iter().all(|v| *v == 10.0), "worker {rank}");
                let mut p = vec![rank as f32 + 1.0; 5000];
                reduce_all(&c, local, &mut p, ReduceOp::Sum);
                let want = if rank < 2 { 3.0 } else { 7.0 };
                assert!(p.iter().all(|v| *v == want), "worker {rank}");
                let (keys, _) = c.wire_bytes();
                assert!(keys.iter().all(|k| &*k.tensor == "all"), "{keys:?}");
                assert!(!keys.is_empty());
                c.shutdown("done").unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    finish(job);
}

#[test]
fn a_joined_worker_of_the_machine_counts_as_zeros_and_comes_back_in_step() {
    run_box(3, 0, |rank, addr| {
        let c = on_box(addr, rank);
        let id = c.declare("x", Dtype::F32, 5000).unwrap();
        let mine = |r: u32| vec![r as f32 + 1.0; 5000];
        let mut d = mine(rank);
        reduce_all(&c, id, &mut d, ReduceOp::Sum);
        assert_eq!(d[0], 6.0);
        if rank != 2 {
            for _ in 0..2 {
                let mut d = mine(rank);
                reduce_all(&c, id, &mut d, ReduceOp::Sum);
                assert_eq!((d[0], d[4999]), (3.0, 3.0), "worker {rank}");
            }
            let mut d = mine(rank);
            reduce_all(&c, id, &mut d, ReduceOp::Average);
            assert_eq!(d[0], 1.0, "worker {rank}");
        }
        c.join(Duration::from_secs(20)).unwrap();
        for _ in 0..2 {
            let mut d = mine(rank);
            reduce_all(&c, id, &mut d, ReduceOp::Sum);
            assert_eq!(d[0], 6.0, "worker {rank} after the join");
        }
        // A tensor first used after the join, by everyone.
        let late = c.declare("late", Dtype::F32, 100).unwrap();
        let mut d = mine(rank);
        reduce_all(&c, late, &mut d[..100], ReduceOp::Sum);
        assert_eq!(d[0], 6.0);
        c.shutdown("done").unwrap();
    });
}

#[test]
fn a_crashed_worker_of_the_machine_fails_the_others_by_name_within_seconds() {
    let job = job_on(&["box".to_string()], 2, 0);
    let addr = job.addr.clone();
    let ready = Arc::new(Barrier::new(2));
    let victim = {
        let (addr, ready) = (addr.clone(), Arc::clone(&ready));
        thread::spawn(move || {
            let mut cfg = config_on(&addr, 1, "box");
            cfg.name = "trainer 1".into();
            let c = CommunicationService::start(cfg).unwrap();
            c.declare("w", Dtype::F32, 5000).unwrap();
            ready.wait();
            c
        })
    };
    let c = on_box(&addr, 0);
    let id = c.declare("w", Dtype::F32, 5000).unwrap();
    ready.wait();
    let crashed = victim.join().unwrap();
    let mut data = vec![1f32; 5000];
    // SAFETY: waited for below.
    let h = unsafe { c.push_pull(id, data.as_mut_ptr().cast(), 20_000, 0, ReduceOp::Sum) }.unwrap();
    // Worker 1 dies without leaving, before pushing its share.
    drop(crashed);
    let started = Instant::now();
    let err = c.wait(h, Duration::from_secs(30)).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(10), "{err}");
    assert_eq!(err.code(), ErrorCode::NodeFailed, "{err}");
    assert!(err.to_string().contains("trainer 1"), "{err}");
    assert!(!matches!(err, CommError::Timeout { .. }));
    drop(c);
    finish(job);
}

/// The job's error, as the declarations of a started worker meet it once the
/// coordinator's notice has arrived (it may trail the worker's own start).
fn job_error_of(c: &CommunicationService) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    for i in 0.. {
        match c.declare(&format!("t{i}"), Dtype::F32, 4) {
            Err(e) => return e.to_string(),
            Ok(_) if Instant::now() < deadline => thread::sleep(Duration::from_millis(50)),
            Ok(_) => break,
        }
    }
    panic!("no job error reached the worker within 10 s")
}

#[test]
fn workers_that_disagree_on_shared_memory_are_stopped_naming_the_setting() {
    let job = job_on(&["box".to_string()], 2, 0);
    let errors: Vec<String> = (0..2u32)
        .map(|rank| {
            let addr = job.addr.clone();
            thread::spawn(move || {
                let mut cfg = config_on(&addr, rank, "box");
                cfg.shared_memory = rank == 0;
                // A worker whose declaration came first may start; its next declaration
                // fails with the job's error.
                match CommunicationService::start(cfg) {
                    Err(e) => e.to_string(),
                    Ok(c) => job_error_of(&c),
                }
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    // The first to see the mismatch leaves at once, so the other may see that first.
    assert!(
        errors.iter().any(|e| e.contains("SUMFLOW_SHARED_MEMORY")),
        "{errors:?}"
    );
    assert_eq!(errors.len(), 2);
    finish(job);
}

#[test]
fn a_wait_that_times_out_names_the_members_that_have_not_pushed() {
    let job = job_on(&["box".to_string()], 3, 0);
    let addr = job.addr.clone();
    let done = Arc::new(Barrier::new(3));
    let threads: Vec<_> = (0..3u32)
        .map(|rank| {
            let (addr, done) = (addr.clone(), Arc::clone(&done));
            thread::spawn(move || {
                let c = on_box(&addr, rank);
                let id = c.declare("slow", Dtype::F32, 1000).unwrap();
                if rank != 2 {
                    let mut d = vec![1f32; 1000];
                    // SAFETY: waited for (twice: after the timeout, once worker 2 pushes).
                    let h =
                        unsafe { c.push_pull(id, d.as_mut_ptr().cast(), 4000, 0, ReduceOp::Sum) }
                            .unwrap();
                    let err = c.wait(h, Duration::from_millis(500)).unwrap_err();
                    let msg = err.to_string();
                    assert!(matches!(err, CommError::Timeout { .. }), "{msg}");
                    assert!(
                        msg.contains("waiting for workers [2] to push round 1"),
                        "worker {rank}: {msg}"
                    );
                    done.wait();
                    c.wait(h, Duration::from_secs(20)).unwrap();
                    assert!(d.iter().all(|v| *v == 3.0));
                } else {
                    done.wait();
                    let mut d = vec![1f32; 1000];
                    reduce_all(&c, id, &mut d, ReduceOp::Sum);
                }
                c.shutdown("done").unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    finish(job);
}

/// Workers 0, 1 on machine a; 2, 3 on machine b. The `late` workers issue only once
/// worker 0's wait on its second, small round has timed out: its first round, of `big`
/// f32, holds the second back from its copy-in, and the timeout says why (`says`).
fn a_held_back_copy_in_says_why(late: &'static [u32], big: usize, says: &'static str) {
    let machines = vec!["a".to_string(), "b".to_string()];
    let job = job_on(&machines, 4, 1);
    let gate = Arc::new(Barrier::new(late.len() + 1));
    run_on(job, 4, move |rank, addr| {
        let mut cfg = config_on(addr, rank, &machines[rank as usize / 2]);
        cfg.partition_bytes = Some(1 << 20);
        let c = CommunicationService::start(cfg).unwrap();
        let first = c.declare("first", Dtype::F32, big as u64).unwrap();
        let second = c.declare("second", Dtype::F32, 1000).unwrap();
        if late.contains(&rank) {
            gate.wait();
        }
        let mut a = vec![1f32; big];
        let mut b = vec![1f32; 1000];
        let ha = push_pull(&c, first, &mut a, 0, ReduceOp::Sum);
        let hb = push_pull(&c, second, &mut b, 0, ReduceOp::Sum);
        if rank == 0 {
            let err = c.wait(hb, Duration::from_millis(500)).unwrap_err();
            let msg = err.to_string();
            assert!(matches!(err, CommError::Timeout { .. }), "{msg}");
            assert!(msg.contains(says), "{msg}");
            gate.wait();
        }
        c.wait(ha, Duration::from_secs(20)).unwrap();
        c.wait(hb, Duration::from_secs(20)).unwrap();
        assert!(a.iter().all(|v| *v == 4.0), "worker {rank}");
        assert!(b.iter().all(|v| *v == 4.0), "worker {rank}");
        c.shutdown("done").unwrap();
    });
}

#[test]
fn a_copy_in_held_back_behind_earlier_rounds_says_so_when_it_times_out() {
    // Worker 1 is late: worker 0's first round fills what it copies in ahead of its
    // reduces (5 MiB).
    a_held_back_copy_in_says_why(
        &[1],
        5 << 18,
        "its copy-in waits behind this worker's earlier rounds",
    );
}

#[test]
fn a_copy_in_held_back_by_the_crossing_window_says_so_when_it_times_out() {
    // Machine b is late: machine a's first round fills the crossing window (16 MiB)
    // while it waits for machine b at the servers.
    a_held_back_copy_in_says_why(&[2, 3], 4 << 20, "to come back from the summation servers");
}
