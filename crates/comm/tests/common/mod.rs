//! The jobs the communication service's tests run on 127.0.0.1: a coordinator,
//! colocated and CPU summation servers, and workers as threads.

#![allow(dead_code)] // each test binary uses its own part of the harness

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use sumflow_client::coordinator::CoordinatorOptions;
use sumflow_comm::{CommConfig, CommunicationService, ReduceOp};
use sumflow_coordinator::{CoordinatorConfig, CoordinatorHandle, CoordinatorService};
use sumflow_summation::{
    CoordinatorLink, Membership, ServerConfig, ServerHandle, SummationService,
};
use sumflow_wire::JobToken;

pub fn token() -> JobToken {
    JobToken::new("service-test-token-abcdefgh").unwrap()
}

pub fn options() -> CoordinatorOptions {
    CoordinatorOptions {
        heartbeat_interval: Duration::from_millis(50),
        heartbeat_timeout: Duration::from_secs(5),
        connect_timeout: Duration::from_secs(5),
        ..CoordinatorOptions::default()
    }
}

pub struct Job {
    pub coordinator: CoordinatorHandle,
    pub addr: String,
    pub servers: thread::JoinHandle<Vec<ServerHandle>>,
}

/// A coordinator, one server colocated with each of `workers` machines, and `cpu` more.
pub fn job(workers: u32, cpu: u32) -> Job {
    let machines: Vec<String> = (0..workers).map(host).collect();
    job_on(&machines, workers, cpu)
}

/// Worker `rank`'s machine in a job of one worker per machine.
pub fn host(rank: u32) -> String {
    format!("machine-{rank}")
}

/// A coordinator expecting `workers` workers, one server colocated on each of `machines`,
/// and `cpu` more.
pub fn job_on(machines: &[String], workers: u32, cpu: u32) -> Job {
    let colocated = machines.len() as u32;
    let machines = machines.to_vec();
    let mut cfg = CoordinatorConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        workers,
        colocated + cpu,
        token(),
    );
    cfg.heartbeat_timeout = Duration::from_millis(800);
    cfg.join_timeout = Duration::from_secs(20);
    let coordinator = CoordinatorService::start(cfg).unwrap();
    let addr = coordinator.local_addr().to_string();
    let coord = addr.clone();
    let servers = thread::spawn(move || {
        let starting: Vec<_> = (0..colocated + cpu)
            .map(|i| {
                let coord = coord.clone();
                let host_id = match machines.get(i as usize) {
                    Some(m) => m.clone(),
                    None => format!("cpu-{i}"),
                };
                thread::spawn(move || {
                    let mut cfg = ServerConfig::standalone(1, token());
                    cfg.membership = Membership::Coordinator(CoordinatorLink {
                        addr: coord,
                        advertise_host: "127.0.0.1".into(),
                        host_id,
                        requested_rank: Some(i),
                        join_timeout: Duration::from_secs(20),
                        options: options(),
                    });
                    SummationService::start(cfg).unwrap()
                })
            })
            .collect();
        starting.into_iter().map(|t| t.join().unwrap()).collect()
    });
    Job {
        coordinator,
        addr,
        servers,
    }
}

/// Worker `rank`'s configuration: partitions of 4 KiB, the default scheduler.
pub fn config(addr: &str, rank: u32) -> CommConfig {
    config_on(addr, rank, &host(rank))
}

/// Worker `rank`'s configuration on machine `host_id`.
pub fn config_on(addr: &str, rank: u32, host_id: &str) -> CommConfig {
    let mut cfg = CommConfig::new(addr, token(), host_id);
    cfg.rank = Some(rank);
    cfg.name = format!("trainer {rank}");
    cfg.partition_bytes = Some(4096);
    cfg.coordinator_options = options();
    cfg.declare_timeout = Duration::from_secs(10);
    cfg
}

pub fn worker(addr: &str, rank: u32) -> CommunicationService {
    CommunicationService::start(config(addr, rank)).unwrap()
}

/// Runs `body(rank, coordinator address)` on a thread per worker of a job with `workers`
/// machines and `cpu` CPU servers, then ends the job.
pub fn run_job(workers: u32, cpu: u32, body: impl Fn(u32, &str) + Send + Sync + 'static) {
    run_on(job(workers, cpu), workers, body);
}

/// Runs `body(rank, coordinator address)` on a thread per worker of `job`'s `workers`, then
/// ends the job.
pub fn run_on(job: Job, workers: u32, body: impl Fn(u32, &str) + Send + Sync + 'static) {
    let body = Arc::new(body);
    let threads: Vec<_> = (0..workers)
        .map(|w| {
            let (addr, body) = (job.addr.clone(), Arc::clone(&body));
            thread::spawn(move || body(w, &addr))
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    finish(job);
}

pub fn finish(job: Job) {
    for s in job.servers.join().unwrap() {
        s.shutdown();
        s.wait();
    }
    job.coordinator.shutdown();
    let _ = job.coordinator.wait();
}

pub fn push_pull(
    c: &CommunicationService,
    id: u32,
    data: &mut [f32],
    priority: i64,
    op: ReduceOp,
) -> u64 {
    // SAFETY: every caller waits on the handle before touching `data` again.
    unsafe { c.push_pull(id, data.as_mut_ptr().cast(), data.len() * 4, priority, op) }.unwrap()
}

/// Sums `data[t]` as tensor `ids[t]` (priority t) for every t at once, and waits for all.
pub fn sum_all(c: &CommunicationService, ids: &[u32], data: &mut [Vec<f32>], op: ReduceOp) {
    let handles: Vec<u64> = data
        .iter_mut()
        .enumerate()
        .map(|(t, d)| push_pull(c, ids[t], d, t as i64, op))
        .collect();
    for h in handles {
        c.wait(h, Duration::from_secs(20)).unwrap();
    }
}
