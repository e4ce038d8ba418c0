//! A worker of the local demo job (`scripts/run-local.sh`): joins the coordinator, spreads
//! a ResNet-50-shaped gradient set over the job's summation servers in 4 MB partitions,
//! and runs synchronous rounds of push and pull, checking every sum exactly.
//!
//! Configuration comes from the environment the script sets: SUMFLOW_COORDINATOR,
//! SUMFLOW_JOB_TOKEN, SUMFLOW_RANK, SUMFLOW_ROUNDS.

use std::process::ExitCode;
use std::thread;
use std::time::{Duration, Instant};

use sumflow_client::coordinator::{CoordinatorClient, CoordinatorOptions};
use sumflow_client::{ClientError, Reply, ServerClient, ServerOptions};
use sumflow_wire::{BarrierGroup, Dtype, JobToken, Registration, Role};

const PARTITION_BYTES: usize = 4 << 20;

/// ResNet-50's parameter tensors in element counts (161 tensors, 25.6M elements): each
/// convolution with its batch-norm scale and shift, bottleneck blocks of widths 64 to 512
/// with a projection shortcut in each stage's first block, then the classifier.
fn resnet50() -> Vec<usize> {
    let mut t = Vec::new();
    let mut conv_bn =
        |cin: usize, cout: usize, k: usize| t.extend([cin * cout * k * k, cout, cout]);
    conv_bn(3, 64, 7);
    let mut cin = 64;
    for (blocks, width) in [(3, 64), (4, 128), (6, 256), (3, 512)] {
        for b in 0..blocks {
            conv_bn(cin, width, 1);
            conv_bn(width, width, 3);
            conv_bn(width, width * 4, 1);
            if b == 0 {
                conv_bn(cin, width * 4, 1);
            }
            cin = width * 4;
        }
    }
    t.extend([2048 * 1000, 1000]);
    t
}

fn env(name: &str) -> Result<String, String> {
    std::env::var(name).map_err(|_| format!("{name} is not set"))
}

/// Partitions of every tensor, as (elements) per key, in declaration order.
fn partitions() -> Vec<usize> {
    let per = PARTITION_BYTES / 4;
    let mut out = Vec::new();
    for elements in resnet50() {
        let mut left = elements;
        while left > 0 {
            out.push(left.min(per));
            left -= left.min(per);
        }
    }
    out
}

fn value(key: usize, round: u64, rank: u32, i: usize) -> i32 {
    ((key * 31 + i * 7) as i32 ^ (round as i32 * 131)) % 1000 + rank as i32
}

fn run() -> Result<(), String> {
    let rank: u32 = env("SUMFLOW_RANK")?
        .parse()
        .map_err(|e| format!("SUMFLOW_RANK: {e}"))?;
    let rounds: u64 = env("SUMFLOW_ROUNDS")
        .unwrap_or_else(|_| "10".into())
        .parse()
        .map_err(|e| format!("SUMFLOW_ROUNDS: {e}"))?;
    let token = JobToken::load(None).map_err(|e| e.to_string())?;
    let reg = Registration {
        role: Role::Worker,
        requested_rank: Some(rank),
        host: "127.0.0.1".into(),
        port: 0,
        host_id: format!("local-{rank}"),
        pid: std::process::id(),
        link_mbit: 0,
        name: format!("demo worker {rank}"),
    };
    let err = |e: ClientError| e.to_string();
    let job = CoordinatorClient::join(
        &env("SUMFLOW_COORDINATOR")?,
        &token,
        reg,
        Duration::from_secs(60),
        CoordinatorOptions::default(),
    )
    .map_err(err)?;
    let map = job.cluster_map().clone();
    let workers = map.workers.len() as i32;
    let opts = ServerOptions::default();
    let conns: Vec<ServerClient> = map
        .servers
        .iter()
        .map(|s| {
            ServerClient::connect(
                &s.addr(),
                &token,
                rank,
                &format!("demo worker {rank}"),
                &opts,
            )
        })
        .collect::<Result<_, _>>()
        .map_err(err)?;
    let parts = partitions();
    let total: usize = parts.iter().sum::<usize>() * 4;
    if rank == 0 {
        println!(
            "job {}: {} workers, {} servers; {} partitions, {:.1} MB of gradients per round",
            map.job_id,
            workers,
            map.servers.len(),
            parts.len(),
            total as f64 / 1e6
        );
    }
    // One pipeline per server: a sender and a receiver thread each.
    let mut handles = Vec::new();
    for (s, conn) in conns.into_iter().enumerate() {
        let mine: Vec<(usize, usize)> = parts
            .iter()
            .copied()
            .enumerate()
            .filter(|(k, _)| k % map.servers.len() == s)
            .collect();
        let (mut tx, mut rx) = (conn.tx, conn.rx);
        for &(k, n) in &mine {
            tx.init_key(k as u64, Dtype::I32, (n * 4) as u64, None)
                .map_err(err)?;
            match rx.recv().map_err(err)? {
                Reply::InitAck { .. } => {}
                other => return Err(format!("unexpected {other:?}")),
            }
        }
        handles.push((tx, rx, mine));
    }
    let started = Instant::now();
    for round in 1..=rounds {
        let t0 = Instant::now();
        let mut threads = Vec::new();
        for (mut tx, mut rx, mine) in handles.drain(..) {
            threads.push(thread::spawn(move || -> Result<_, String> {
                let send_keys = mine.clone();
                let sender = thread::spawn(move || -> Result<_, ClientError> {
                    for &(k, n) in &send_keys {
                        let data: Vec<u8> = (0..n).flat_map(|i| value(k, round, rank, i).to_le_bytes()).collect();
                        tx.push(k as u64, round, Dtype::I32, &data)?;
                        tx.pull(k as u64, round, true)?;
                    }
                    Ok(tx)
                });
                for _ in 0..mine.len() {
                    match rx.recv().map_err(err)? {
                        Reply::Sum(p) => {
                            let n = p.data.len() / 4;
                            let k = p.key as usize;
                            for (i, c) in p.data.chunks_exact(4).enumerate().step_by(97) {
                                let want: i32 = (0..workers as u32).map(|r| value(k, round, r, i)).sum();
                                let got = i32::from_le_bytes(c.try_into().expect("4 bytes"));
                                if got != want {
                                    return Err(format!("key {k} round {round} element {i} of {n}: got {got}, expected {want}"));
                                }
                            }
                        }
                        other => return Err(format!("unexpected {other:?}")),
                    }
                }
                let tx = sender.join().map_err(|_| "sender panicked".to_string())?.map_err(err)?;
                Ok((tx, rx, mine))
            }));
        }
        for t in threads {
            handles.push(t.join().map_err(|_| "pipeline panicked".to_string())??);
        }
        job.barrier(BarrierGroup::Workers, Duration::from_secs(60))
            .map_err(err)?;
        let secs = t0.elapsed().as_secs_f64();
        println!(
            "round {round:>3}/{rounds}  {:>7.1} MB synchronized  {:>7.1} MB/s  (sums verified)",
            total as f64 / 1e6,
            total as f64 / secs / 1e6
        );
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "done: {rounds} rounds in {secs:.2}s, {:.1} MB/s per worker",
        rounds as f64 * total as f64 / secs / 1e6
    );
    for (mut tx, _, _) in handles {
        tx.shutdown("demo finished").map_err(err)?;
    }
    job.leave("demo finished").map_err(err)
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("demo worker failed: {e}");
            ExitCode::FAILURE
        }
    }
}
