//! Whole jobs on 127.0.0.1: a coordinator, summation servers that join through it, and
//! workers that push to every server; then a worker that hangs, caught by heartbeats.

use std::net::TcpStream;
use std::thread;
use std::time::{Duration, Instant};

use sumflow_client::coordinator::{CoordinatorClient, CoordinatorOptions};
use sumflow_client::{ClientError, ServerClient, ServerOptions};
use sumflow_coordinator::{CoordinatorConfig, CoordinatorHandle, CoordinatorService};
use sumflow_summation::{
    CoordinatorLink, Membership, ServerConfig, ServerHandle, SummationService,
};
use sumflow_wire::io::{self, FrameReader};
use sumflow_wire::{
    BarrierGroup, Codec, Dtype, ErrorCode, JobToken, Message, Peer, PushMode, ReduceOp,
    Registration, Role, Service,
};

const HEARTBEAT_TIMEOUT: Duration = Duration::from_millis(800);

fn token() -> JobToken {
    JobToken::new("job-test-token-abcdefghijkl").unwrap()
}

fn options() -> CoordinatorOptions {
    CoordinatorOptions {
        heartbeat_interval: Duration::from_millis(50),
        heartbeat_timeout: Duration::from_secs(5),
        connect_timeout: Duration::from_secs(5),
        ..CoordinatorOptions::default()
    }
}

fn coordinator(workers: u32, servers: u32) -> (CoordinatorHandle, String) {
    let mut cfg = CoordinatorConfig::new("127.0.0.1:0".parse().unwrap(), workers, servers, token());
    cfg.heartbeat_timeout = HEARTBEAT_TIMEOUT;
    cfg.join_timeout = Duration::from_secs(20);
    cfg.job_id = "job-test".into();
    let h = CoordinatorService::start(cfg).unwrap();
    let addr = h.local_addr().to_string();
    (h, addr)
}

/// Servers register from threads: each blocks until the whole job has joined.
fn servers(coord: &str, count: u32) -> thread::JoinHandle<Vec<ServerHandle>> {
    let coord = coord.to_string();
    thread::spawn(move || {
        let starting: Vec<_> = (0..count)
            .map(|i| {
                let coord = coord.clone();
                thread::spawn(move || {
                    let mut cfg = ServerConfig::standalone(1, token());
                    cfg.membership = Membership::Coordinator(CoordinatorLink {
                        addr: coord,
                        advertise_host: "127.0.0.1".into(),
                        host_id: format!("host-{i}"),
                        requested_rank: None,
                        join_timeout: Duration::from_secs(20),
                        options: options(),
                    });
                    SummationService::start(cfg).unwrap()
                })
            })
            .collect();
        starting.into_iter().map(|t| t.join().unwrap()).collect()
    })
}

fn join_worker(coord: &str, rank: u32) -> CoordinatorClient {
    let reg = Registration {
        role: Role::Worker,
        requested_rank: Some(rank),
        host: "127.0.0.1".into(),
        port: 0,
        host_id: format!("host-{rank}"),
        pid: std::process::id(),
        link_mbit: 0,
        name: format!("trainer {rank}"),
    };
    CoordinatorClient::join(coord, &token(), reg, Duration::from_secs(20), options()).unwrap()
}

fn connect_servers(job: &CoordinatorClient) -> Vec<ServerClient> {
    let opts = ServerOptions {
        connect_timeout: Duration::from_secs(5),
        reply_timeout: Some(Duration::from_secs(10)),
        ..ServerOptions::default()
    };
    job.cluster_map()
        .servers
        .iter()
        .map(|s| {
            let name = format!("trainer {}", job.rank());
            ServerClient::connect(&s.addr(), &token(), job.rank(), &name, &opts).unwrap()
        })
        .collect()
}

#[test]
fn a_job_forms_sums_across_servers_and_ends_cleanly() {
    let (coord, addr) = coordinator(3, 2);
    let servers = servers(&addr, 2);
    let workers: Vec<_> = (0..3u32)
        .map(|w| {
            let addr = addr.clone();
            thread::spawn(move || {
                let job = join_worker(&addr, w);
                assert_eq!(job.rank(), w);
                let map = job.cluster_map().clone();
                assert_eq!((map.workers.len(), map.servers.len()), (3, 2));
                let mut conns = connect_servers(&job);
                // Keys spread over the servers; each worker agrees on where each key lives.
                let keys: Vec<u64> = (0..8).collect();
                for &k in &keys {
                    conns[(k % 2) as usize]
                        .init_key(k, Dtype::I64, 8 * 100, None)
                        .unwrap();
                }
                for round in 1..=5u64 {
                    for &k in &keys {
                        let data: Vec<u8> = (0..100i64)
                            .flat_map(|i| (i * k as i64 + round as i64 + w as i64).to_le_bytes())
                            .collect();
                        let p = conns[(k % 2) as usize]
                            .push_pull(k, round, Dtype::I64, &data)
                            .unwrap();
                        let want: Vec<u8> = (0..100i64)
                            .flat_map(|i| (3 * (i * k as i64 + round as i64) + 3).to_le_bytes())
                            .collect();
                        assert_eq!(p.data, want, "worker {w} key {k} round {round}");
                    }
                    job.barrier(BarrierGroup::Workers, Duration::from_secs(10))
                        .unwrap();
                }
                for c in conns {
                    c.shutdown("training finished").unwrap();
                }
                job.leave("training finished").unwrap();
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    // With every worker gone, the coordinator ends the job and the servers stop.
    for s in servers.join().unwrap() {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !s.is_finished() {
            assert!(
                Instant::now() < deadline,
                "server did not stop after the job ended"
            );
            thread::sleep(Duration::from_millis(20));
        }
        s.wait();
    }
    let outcome = coord.wait().unwrap();
    assert!(outcome.failed.is_empty(), "{:?}", outcome.failed);
}

/// Registers with the coordinator by hand and then goes silent: a process that hangs with
/// its sockets open. Only the heartbeat timeout can catch it.
fn hanging_worker(coord: &str, rank: u32) -> TcpStream {
    let mut s = TcpStream::connect(coord).unwrap();
    let me = Peer {
        role: Role::Worker,
        rank: Some(rank),
        name: format!("trainer {rank}"),
    };
    io::connect(&mut s, &token(), Service::Coordinator, &me).unwrap();
    let reg = Registration {
        role: Role::Worker,
        requested_rank: Some(rank),
        host: "127.0.0.1".into(),
        port: 0,
        host_id: format!("host-{rank}"),
        pid: 0,
        link_mbit: 0,
        name: format!("trainer {rank}"),
    };
    io::write_message(&mut s, &Message::Register(reg)).unwrap();
    s
}

#[test]
fn a_hung_worker_is_named_to_the_others_within_the_heartbeat_timeout() {
    let (coord, addr) = coordinator(3, 1);
    let servers = servers(&addr, 1);
    let hung = hanging_worker(&addr, 2);
    let live: Vec<_> = (0..2)
        .map(|w| {
            let addr = addr.clone();
            thread::spawn(move || join_worker(&addr, w))
        })
        .collect();
    let live: Vec<CoordinatorClient> = live.into_iter().map(|t| t.join().unwrap()).collect();
    let mut reader = FrameReader::new(&hung, 1 << 20);
    assert!(matches!(
        reader.read_owned().unwrap().0,
        Message::ClusterMap { your_rank: 2, .. }
    ));
    // The hung worker also holds a server connection open, and hung halfway through the
    // payload of a push of another key.
    let map = live[0].cluster_map().clone();
    let opts = ServerOptions::default();
    let mut hung_server =
        ServerClient::connect(&map.servers[0].addr(), &token(), 2, "trainer 2", &opts).unwrap();
    hung_server.init_key(1, Dtype::F32, 4, None).unwrap();
    hung_server.init_key(2, Dtype::F32, 1 << 16, None).unwrap();
    let push = Message::Push {
        key: 2,
        round: 1,
        dtype: Dtype::F32,
        codec: Codec::Raw,
        mode: PushMode::Sum,
        op: ReduceOp::Sum,
    }
    .encode_with_payload(&[0; 1 << 16]);
    hung_server.tx.send_bytes(&push[..push.len() / 2]).unwrap();
    let ServerClient {
        tx: _hung_tx,
        rx: mut hung_rx,
    } = hung_server;
    let (closed_tx, closed) = std::sync::mpsc::channel();
    thread::spawn(move || closed_tx.send(hung_rx.recv().map(|_| ())));

    let started = Instant::now();
    let waits: Vec<_> = live
        .iter()
        .map(|job| {
            let mut c = connect_servers(job).pop().unwrap();
            thread::spawn(move || {
                c.init_key(1, Dtype::F32, 4, None).unwrap();
                c.tx.push(1, 1, Dtype::F32, &1f32.to_le_bytes()).unwrap();
                c.tx.pull(1, 1, true).unwrap();
                c.rx.recv()
            })
        })
        .collect();
    for w in waits {
        match w.join().unwrap() {
            Err(ClientError::Remote {
                code: ErrorCode::NodeFailed,
                message,
                ..
            }) => {
                assert!(message.contains("worker 2 (trainer 2)"), "{message}");
                assert!(message.contains("no heartbeat"), "{message}");
            }
            other => panic!("expected a NodeFailed naming worker 2, got {other:?}"),
        }
    }
    let took = started.elapsed();
    assert!(took < HEARTBEAT_TIMEOUT * 4, "detected after {took:?}");
    // The coordinator told the live workers too, and a barrier fails naming the culprit.
    for job in &live {
        let err = job
            .barrier(BarrierGroup::Workers, Duration::from_secs(5))
            .unwrap_err();
        assert!(err.to_string().contains("trainer 2"), "{err}");
    }
    // The server closed the hung worker's connection once the coordinator named it: a
    // worker that wakes finds it closed, and the server holds no thread or buffer for it.
    match closed.recv_timeout(Duration::from_secs(10)) {
        Ok(Err(_)) => {}
        Ok(Ok(())) => panic!("the hung worker's connection answered instead of closing"),
        Err(_) => panic!("the server kept the hung worker's connection open"),
    }
    drop(hung);
    for job in live {
        job.leave("giving up").unwrap();
    }
    for s in servers.join().unwrap() {
        s.shutdown();
        s.wait();
    }
    coord.shutdown();
    let outcome = coord.wait().unwrap();
    assert!(outcome
        .failed
        .iter()
        .any(|(id, _, _)| id.rank == 2 && id.role == Role::Worker));
}
