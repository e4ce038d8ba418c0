//! The pipeline against real summation servers on 127.0.0.1.

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use sumflow_client::{ServerClient, ServerOptions};
use sumflow_plan::partition::Partition;
use sumflow_plan::scheduler::{Schedule, SchedulerKind};
use sumflow_summation::{ServerConfig, ServerHandle, SummationService};
use sumflow_wire::{Dtype, ErrorCode, JobToken, KeyCodec};

use super::{HostSlice, PartTask, Pipeline, ServerLink};
use crate::error::CommError;
use crate::handles::Handles;
use crate::trace::Tracer;

fn token() -> JobToken {
    JobToken::new("pipeline-test-token-123456").unwrap()
}

fn servers(workers: u32, count: usize) -> Vec<ServerHandle> {
    (0..count)
        .map(|_| SummationService::start(ServerConfig::standalone(workers, token())).unwrap())
        .collect()
}

/// A pipeline with `lanes` connections to each server.
fn pipeline(
    servers: &[String],
    rank: u32,
    lanes: usize,
    kind: SchedulerKind,
    handles: Arc<Handles>,
) -> Pipeline {
    let opts = ServerOptions {
        reply_timeout: None,
        ..ServerOptions::default()
    };
    let links = servers
        .iter()
        .map(|addr| ServerLink {
            name: format!("server at {addr}"),
            lanes: (0..lanes)
                .map(|_| {
                    let c = ServerClient::connect(addr, &token(), rank, &format!("w{rank}"), &opts)
                        .unwrap();
                    (c.tx, c.rx)
                })
                .collect(),
        })
        .collect();
    // A one-byte credit and window: one partition in flight per server unless a more
    // urgent one comes, so every test also exercises both.
    let schedule = Schedule {
        credit_bytes: 1,
        window_bytes: 1,
        ..Schedule::new(kind, 1000)
    };
    Pipeline::start(
        links,
        handles,
        schedule,
        1000,
        Arc::new(Tracer::without_window(0, "test")),
        0,
        vec!["worker 0".into()],
    )
    .unwrap()
}

/// A worker's view in these tests: its pipeline, and how tensors are cut and placed.
struct Worker {
    pipeline: Pipeline,
    handles: Arc<Handles>,
    part: usize,
    servers: usize,
}

impl Worker {
    fn new(addrs: &[String], rank: u32, part: usize, lanes: usize) -> Worker {
        Worker::with(addrs, rank, part, lanes, SchedulerKind::ByteScheduler)
    }

    fn with(addrs: &[String], rank: u32, part: usize, lanes: usize, kind: SchedulerKind) -> Worker {
        let handles = Arc::new(Handles::default());
        Worker {
            pipeline: pipeline(addrs, rank, lanes, kind, Arc::clone(&handles)),
            handles,
            part,
            servers: addrs.len(),
        }
    }

    /// Enqueues one push_pull of `data`, partition i on server i mod servers.
    fn push_pull(&self, tensor: u32, data: &mut [f32], round: u64, divisor: Option<u32>) -> u64 {
        let elements = data.len() as u64;
        let part = self.part as u64;
        let parts: Vec<Partition> = (0..elements.div_ceil(part))
            .map(|i| Partition {
                key: ((tensor as u64) << 32) | i,
                tensor,
                offset: i * part * 4,
                bytes: part.min(elements - i * part) * 4,
                server: (i % self.servers as u64) as u32,
            })
            .collect();
        let h = self
            .handles
            .start(tensor, &format!("tensor{tensor}"), &parts)
            .unwrap();
        // SAFETY: `data` outlives the handle: the tests wait on it before touching `data`.
        let whole = unsafe { HostSlice::new(data.as_mut_ptr().cast(), data.len() * 4) }.unwrap();
        let tasks = parts
            .into_iter()
            .enumerate()
            .map(|(i, partition)| PartTask {
                handle: h,
                partition,
                round,
                dtype: Dtype::F32,
                data: whole.sub(partition.offset as usize, partition.bytes as usize),
                codec: KeyCodec::RAW,
                divisor,
                members: None,
                op: sumflow_wire::ReduceOp::Sum,
                pushes: true,
                wants_sum: true,
                skips: None,
                name: Arc::from(format!("tensor{tensor}")),
                index: i as u32,
                delta: None,
            })
            .collect();
        // Later tensors are more urgent, as the first layers' gradients come last.
        self.pipeline
            .enqueue(tensor, &format!("tensor{tensor}"), -(tensor as i64), tasks);
        h
    }

    fn wait(&self, h: u64, timeout: Duration) -> Result<(), CommError> {
        self.handles
            .wait(h, timeout, |s| self.pipeline.server_name(s))
    }
}

#[test]
fn workers_average_and_sum_many_tensors_over_two_servers_and_several_lanes() {
    for kind in SchedulerKind::ALL {
        many_tensors(kind);
    }
}

fn many_tensors(kind: SchedulerKind) {
    let workers = 3u32;
    let srv = servers(workers, 2);
    let addrs: Vec<String> = srv.iter().map(|s| s.local_addr().to_string()).collect();
    let sizes = [1usize, 7, 1000, 4096, 10_001];
    let threads: Vec<_> = (0..workers)
        .map(|w| {
            let addrs = addrs.clone();
            thread::spawn(move || {
                // Workers need not agree on lanes: each key sticks to one of its own.
                let wk = Worker::with(&addrs, w, 1000, 1 + w as usize, kind);
                for round in 1..=4u64 {
                    let mut tensors: Vec<Vec<f32>> = sizes
                        .iter()
                        .enumerate()
                        .map(|(t, &n)| {
                            (0..n)
                                .map(|i| (i + t + w as usize) as f32 + round as f32)
                                .collect()
                        })
                        .collect();
                    let average = round % 2 == 0;
                    let hs: Vec<u64> = tensors
                        .iter_mut()
                        .enumerate()
                        .map(|(t, data)| {
                            wk.push_pull(t as u32, data, round, average.then_some(workers))
                        })
                        .collect();
                    for h in hs {
                        wk.wait(h, Duration::from_secs(20)).unwrap();
                    }
                    for (t, data) in tensors.iter().enumerate() {
                        for (i, v) in data.iter().enumerate() {
                            let sum: f32 = (0..workers)
                                .map(|w| (i + t + w as usize) as f32 + round as f32)
                                .sum();
                            let want = if average { sum / workers as f32 } else { sum };
                            assert_eq!(*v, want, "worker {w} round {round} tensor {t} element {i}");
                        }
                    }
                }
                wk.pipeline.shutdown("test done");
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    for s in srv {
        s.shutdown();
        s.wait();
    }
}

#[test]
fn a_lost_server_fails_the_waiting_handles_by_name() {
    let srv = servers(2, 2);
    let addrs: Vec<String> = srv.iter().map(|s| s.local_addr().to_string()).collect();
    // Losing a server loses all its lanes; the first to notice fails it.
    let wk = Worker::new(&addrs, 0, 1000, 2);
    // Worker 1 never comes, so the round waits; then server 1 goes away.
    let mut data = vec![1.0f32; 5000];
    let h = wk.push_pull(0, &mut data, 1, None);
    let mut srv = srv;
    let gone = srv.pop().unwrap();
    gone.shutdown();
    gone.wait();
    let err = wk.wait(h, Duration::from_secs(10)).unwrap_err();
    assert_eq!(err.code(), ErrorCode::NodeFailed, "{err}");
    assert!(err.to_string().contains(&addrs[1]), "{err}");
    // Later work for that server fails at once rather than hanging.
    let h = wk.push_pull(1, &mut data, 1, None);
    let err = wk.wait(h, Duration::from_secs(10)).unwrap_err();
    assert!(err.to_string().contains("unreachable"), "{err}");
    wk.pipeline.shutdown("test done");
    for s in srv {
        s.shutdown();
        s.wait();
    }
}

#[test]
fn a_stuck_round_times_out_naming_the_tensor_and_server() {
    let srv = servers(2, 1);
    let addrs: Vec<String> = srv.iter().map(|s| s.local_addr().to_string()).collect();
    let wk = Worker::new(&addrs, 0, 1000, 1);
    let mut data = vec![0.5f32; 10];
    let h = wk.push_pull(9, &mut data, 1, None);
    let err = wk.wait(h, Duration::from_millis(300)).unwrap_err();
    assert!(matches!(err, CommError::Timeout { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("tensor9") && msg.contains(&addrs[0]), "{msg}");
    wk.pipeline.shutdown("test done");
    for s in srv {
        s.shutdown();
        s.wait();
    }
}

#[test]
fn the_sum_of_a_failed_operation_is_skipped_and_its_tensor_left_alone() {
    let srv = servers(2, 1);
    let addrs: Vec<String> = srv.iter().map(|s| s.local_addr().to_string()).collect();
    let wk = Worker::new(&addrs, 0, 1000, 1);
    let opts = ServerOptions {
        reply_timeout: Some(Duration::from_secs(10)),
        ..ServerOptions::default()
    };
    let mut other = ServerClient::connect(&addrs[0], &token(), 1, "w1", &opts).unwrap();
    let twos: Vec<u8> = [2.0f32; 10].iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut sum_with_other = |tensor: u64| {
        other.init_key(tensor << 32, Dtype::F32, 40, None).unwrap();
        other.push_pull(tensor << 32, 1, Dtype::F32, &twos).unwrap();
    };
    // Tensor 1 is more urgent than tensor 0, so once tensor 0's round completed,
    // tensor 1's push has gone out too.
    let mut failed = vec![1.0f32; 10];
    let mut probe = vec![1.0f32; 10];
    let h = wk.push_pull(1, &mut failed, 1, None);
    let h0 = wk.push_pull(0, &mut probe, 1, None);
    sum_with_other(0);
    wk.wait(h0, Duration::from_secs(10)).unwrap();
    wk.handles
        .fail(h, |t| CommError::Invalid(format!("{t} given up")));
    assert!(wk.wait(h, Duration::from_secs(10)).is_err());
    // Tensor 1's sum arrives after its operation failed: it must not be written anywhere,
    // and the receiver goes on to deliver later sums.
    sum_with_other(1);
    let mut later = vec![3.0f32; 10];
    let h2 = wk.push_pull(2, &mut later, 1, None);
    sum_with_other(2);
    wk.wait(h2, Duration::from_secs(10)).unwrap();
    assert_eq!(later, [5.0; 10]);
    assert_eq!(
        failed, [1.0; 10],
        "a failed operation's tensor is never written"
    );
    wk.pipeline.shutdown("test done");
    for s in srv {
        s.shutdown();
        s.wait();
    }
}
