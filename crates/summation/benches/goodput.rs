//! Server goodput on loopback against raw TCP moving the same bytes in the same pattern.
//!
//! One worker pushes 256 MB in 4 MB partitions and pulls each sum back, with pushes and
//! pulls in flight concurrently (a sender thread and a receiver thread). The reference is a
//! raw socket pair doing exactly that: each 4 MB message is read whole by the far end and
//! sent back, while the near end keeps sending; the far end reads and writes on separate
//! threads. Both run in this process, alternately, and the best and the median of several
//! repetitions of each are compared.
//!
//! `cargo bench -p sumflow-summation --bench goodput` (env: SUMFLOW_BENCH_REPS, default 5;
//! SUMFLOW_BENCH_QUICK=1 or --quick for a small smoke run).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use sumflow_client::{Reply, ServerClient, ServerOptions};
use sumflow_summation::{ServerConfig, SummationService};
use sumflow_wire::{Dtype, JobToken};

struct Shape {
    partitions: usize,
    partition_bytes: usize,
}

impl Shape {
    fn total(&self) -> usize {
        self.partitions * self.partition_bytes
    }
}

/// Raw TCP: the far end reads each message whole and sends it back, reading and writing
/// on separate threads (with four buffers in flight, as the server has) so both directions
/// stay busy at once: the best plain sockets can do with this pattern. Timed per round on
/// one connection, like the sumflow side.
fn raw_tcp(shape: &Shape, rounds: usize) -> Vec<Duration> {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let per_round = shape.partitions;
    let messages = per_round * rounds;
    let size = shape.partition_bytes;
    let echo = thread::spawn(move || {
        let (mut inbound, _) = listener.accept().unwrap();
        inbound.set_nodelay(true).unwrap();
        let mut outbound = inbound.try_clone().unwrap();
        let (full_tx, full_rx) = mpsc::sync_channel::<Vec<u8>>(4);
        let (free_tx, free_rx) = mpsc::sync_channel::<Vec<u8>>(4);
        for _ in 0..4 {
            free_tx.send(vec![0u8; size]).unwrap();
        }
        let writer = thread::spawn(move || {
            for buf in full_rx {
                outbound.write_all(&buf).unwrap();
                let _ = free_tx.send(buf);
            }
        });
        for _ in 0..messages {
            let mut buf = free_rx.recv().unwrap();
            inbound.read_exact(&mut buf).unwrap();
            full_tx.send(buf).unwrap();
        }
        drop(full_tx);
        writer.join().unwrap();
    });
    let mut tx = TcpStream::connect(addr).unwrap();
    tx.set_nodelay(true).unwrap();
    let mut rx = tx.try_clone().unwrap();
    let data = vec![1u8; size];
    let mut buf = vec![0u8; size];
    let mut times = Vec::new();
    for _ in 0..rounds {
        let start = Instant::now();
        let receiver = thread::spawn(move || {
            for _ in 0..per_round {
                rx.read_exact(&mut buf).unwrap();
            }
            (rx, buf)
        });
        for _ in 0..per_round {
            tx.write_all(&data).unwrap();
        }
        (rx, buf) = receiver.join().unwrap();
        times.push(start.elapsed());
    }
    echo.join().unwrap();
    times
}

/// sumflow: one round of push and pull for every partition, timed per round.
fn sumflow(shape: &Shape, rounds: u64) -> Vec<Duration> {
    let token = JobToken::new("goodput-benchmark-token-000").unwrap();
    let mut cfg = ServerConfig::standalone(1, token.clone());
    cfg.settings.max_body = (shape.partition_bytes + 4096) as u32;
    let server = SummationService::start(cfg).unwrap();
    let addr = server.local_addr().to_string();
    let opts = ServerOptions {
        max_body: (shape.partition_bytes + 4096) as u32,
        ..ServerOptions::default()
    };
    let client = ServerClient::connect(&addr, &token, 0, "goodput", &opts).unwrap();
    let (mut tx, mut rx) = (client.tx, client.rx);
    let n = shape.partitions;
    let elements = shape.partition_bytes / 4;
    for key in 0..n as u64 {
        tx.init_key(key, Dtype::F32, shape.partition_bytes as u64, None)
            .unwrap();
        assert_eq!(rx.recv().unwrap(), Reply::InitAck { key });
    }
    let data: Vec<u8> = (0..elements)
        .flat_map(|i| (i as f32).to_le_bytes())
        .collect();
    // Like the raw side, sums are read into one buffer, reused.
    let mut sums = vec![0u8; elements * 4];
    let mut times = Vec::new();
    for round in 1..=rounds {
        let start = Instant::now();
        let receiver = thread::spawn(move || {
            let mut summed = 0;
            while summed < n {
                match rx.recv_header().unwrap() {
                    Reply::Sum(_) => {
                        rx.read_sum(&mut sums).unwrap();
                        summed += 1;
                    }
                    Reply::PushAck { .. } => {}
                    other => panic!("unexpected {other:?}"),
                }
            }
            (rx, sums)
        });
        for key in 0..n as u64 {
            tx.push(key, round, Dtype::F32, &data).unwrap();
            tx.pull(key, round, true).unwrap();
        }
        (rx, sums) = receiver.join().unwrap();
        times.push(start.elapsed());
    }
    tx.shutdown("benchmark done").unwrap();
    server.shutdown();
    server.wait();
    times
}

fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick")
        || std::env::var("SUMFLOW_BENCH_QUICK").is_ok_and(|v| v == "1");
    let reps: usize = std::env::var("SUMFLOW_BENCH_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if quick { 2 } else { 5 });
    let shape = if quick {
        Shape {
            partitions: 8,
            partition_bytes: 1 << 20,
        }
    } else {
        Shape {
            partitions: 64,
            partition_bytes: 4 << 20,
        }
    };
    eprintln!(
        "goodput: {} MB in {} partitions of {} MB, {reps} repetitions each, interleaved",
        shape.total() >> 20,
        shape.partitions,
        shape.partition_bytes >> 20
    );
    let mut raw = Vec::new();
    let mut ours = Vec::new();
    for rep in 0..reps {
        let raw_rounds = raw_tcp(&shape, 3);
        raw.extend_from_slice(&raw_rounds[1..]);
        // The first round on either side also pages in buffers: it is reported, not counted.
        let rounds = sumflow(&shape, 3);
        ours.extend_from_slice(&rounds[1..]);
        eprintln!(
            "  rep {}/{reps}: raw tcp {:.2} GB/s, sumflow {:.2} GB/s (first rounds, not counted: \
             {:.2} and {:.2} GB/s)",
            rep + 1,
            gbps(shape.total(), *raw.last().unwrap()),
            gbps(shape.total(), *ours.last().unwrap()),
            gbps(shape.total(), raw_rounds[0]),
            gbps(shape.total(), rounds[0])
        );
    }
    let best_raw = *raw.iter().min().unwrap();
    let best_ours = *ours.iter().min().unwrap();
    let med = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let (med_raw, med_ours) = (med(&mut raw), med(&mut ours));
    println!("| measure | raw TCP echo | sumflow push/pull | ratio |");
    println!("|---|---|---|---|");
    for (name, r, o) in [("best", best_raw, best_ours), ("median", med_raw, med_ours)] {
        println!(
            "| {name} goodput per direction | {:.2} GB/s | {:.2} GB/s | {:.2}x |",
            gbps(shape.total(), r),
            gbps(shape.total(), o),
            r.as_secs_f64() / o.as_secs_f64()
        );
    }
}
