//! The coordinator and its client over real sockets on 127.0.0.1, with short timeouts.
//! Every wait is bounded so a regression fails instead of hanging.

use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use sumflow_client::coordinator::{CoordinatorClient, CoordinatorOptions, NodeFailure};
use sumflow_client::ClientError;
use sumflow_coordinator::{CoordinatorConfig, CoordinatorHandle, CoordinatorService, JobOutcome};
use sumflow_wire::io::{accept, connect, write_message, FrameReader};
use sumflow_wire::{
    BarrierGroup, ClusterMap, ErrorCode, JobToken, Message, NodeId, NodeInfo, Peer, Registration,
    Role, Service, DEFAULT_MAX_BODY,
};

const HEARTBEAT_TIMEOUT: Duration = Duration::from_millis(500);
const WAIT: Duration = Duration::from_secs(3);

fn token() -> JobToken {
    JobToken::new("coordinator-integration-test-token").unwrap()
}

fn start(workers: u32, servers: u32) -> (CoordinatorHandle, String) {
    let mut cfg = CoordinatorConfig::new("127.0.0.1:0".parse().unwrap(), workers, servers, token());
    cfg.heartbeat_timeout = HEARTBEAT_TIMEOUT;
    cfg.join_timeout = Duration::from_secs(5);
    cfg.job_id = "itest".into();
    let handle = CoordinatorService::start(cfg).unwrap();
    let addr = handle.local_addr().to_string();
    (handle, addr)
}

fn opts() -> CoordinatorOptions {
    CoordinatorOptions {
        heartbeat_interval: Duration::from_millis(50),
        heartbeat_timeout: HEARTBEAT_TIMEOUT,
        connect_timeout: Duration::from_secs(2),
        max_body: DEFAULT_MAX_BODY,
    }
}

fn reg(role: Role, rank: Option<u32>, name: &str, host_id: &str) -> Registration {
    Registration {
        role,
        requested_rank: rank,
        host: "127.0.0.1".into(),
        port: 7000,
        host_id: host_id.into(),
        pid: std::process::id(),
        link_mbit: 0,
        name: name.into(),
    }
}

/// Joins every registration from its own thread, as separate processes would.
fn join_all(addr: &str, regs: Vec<Registration>) -> Vec<CoordinatorClient> {
    let threads: Vec<_> = regs
        .into_iter()
        .map(|r| {
            let addr = addr.to_string();
            thread::spawn(move || CoordinatorClient::join(&addr, &token(), r, WAIT, opts()))
        })
        .collect();
    threads
        .into_iter()
        .map(|t| t.join().unwrap().expect("join"))
        .collect()
}

/// Waits for the coordinator to stop on its own; a hung coordinator fails the test.
fn outcome(handle: CoordinatorHandle) -> JobOutcome {
    let deadline = Instant::now() + WAIT;
    while !handle.is_finished() {
        assert!(Instant::now() < deadline, "the coordinator did not stop");
        thread::sleep(Duration::from_millis(10));
    }
    handle.wait().expect("coordinator outcome")
}

fn node_failed(err: &ClientError) -> (NodeId, &str, &str) {
    match err {
        ClientError::NodeFailed { node, name, reason } => (*node, name, reason),
        other => panic!("expected NodeFailed, got {other}"),
    }
}

/// A node speaking the protocol by hand: handshake and Register, then whatever the test does.
fn raw_node(addr: &str, r: Registration) -> (TcpStream, FrameReader<TcpStream>) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    let me = Peer {
        role: r.role,
        rank: r.requested_rank,
        name: r.name.clone(),
    };
    connect(&mut s, &token(), Service::Coordinator, &me).unwrap();
    write_message(&mut s, &Message::Register(r)).unwrap();
    let reader = FrameReader::new(s.try_clone().unwrap(), DEFAULT_MAX_BODY);
    (s, reader)
}

fn recv_failure(rx: &crossbeam_channel::Receiver<NodeFailure>) -> NodeFailure {
    rx.recv_timeout(WAIT).expect("a failure notice")
}

#[test]
fn nodes_join_from_threads_and_share_one_map_with_colocation() {
    let (handle, addr) = start(3, 2);
    let clients = join_all(
        &addr,
        vec![
            reg(Role::Worker, None, "w-gpu0", "gpu0"),
            reg(Role::Worker, Some(0), "w-gpu1", "gpu1"),
            reg(Role::Worker, None, "w-gpu2", "gpu2"),
            reg(Role::Server, None, "s-gpu0", "gpu0"),
            reg(Role::Server, None, "s-cpu", "cpu"),
        ],
    );
    let map = clients[0].cluster_map().clone();
    assert!(clients.iter().all(|c| *c.cluster_map() == map));
    assert_eq!(map.job_id, "itest");
    assert_eq!(map.workers[0].name, "w-gpu1", "requested rank honoured");
    let mut worker_ranks: Vec<u32> = clients[..3].iter().map(|c| c.rank()).collect();
    worker_ranks.sort();
    assert_eq!(worker_ranks, [0, 1, 2]);
    let mut server_ranks: Vec<u32> = clients[3..].iter().map(|c| c.rank()).collect();
    server_ranks.sort();
    assert_eq!(server_ranks, [0, 1]);
    let names = ["w-gpu0", "w-gpu1", "w-gpu2", "s-gpu0", "s-cpu"];
    for (i, (c, name)) in clients.iter().zip(names).enumerate() {
        let nodes = if i < 3 { &map.workers } else { &map.servers };
        assert_eq!(
            nodes[c.rank() as usize].name,
            name,
            "each node's rank points at itself"
        );
    }
    let gpu0 = clients[0].rank();
    let s_gpu0 = clients[3].rank();
    assert_eq!(map.colocated_servers(gpu0), vec![s_gpu0]);
    assert_eq!(map.colocated_servers(clients[1].rank()), Vec::<u32>::new());
    assert_eq!(map.cpu_only_servers(), vec![clients[4].rank()]);
    for c in clients {
        c.leave("done").unwrap();
    }
    assert!(outcome(handle).failed.is_empty());
}

#[test]
fn barriers_release_workers_and_all_nodes_across_threads() {
    let (handle, addr) = start(2, 1);
    let clients = join_all(
        &addr,
        vec![
            reg(Role::Worker, None, "w0", "a"),
            reg(Role::Worker, None, "w1", "b"),
            reg(Role::Server, None, "s0", "c"),
        ],
    );
    let (workers, server) = clients.split_at(2);
    let server = &server[0];
    thread::scope(|scope| {
        let runs: Vec<_> = workers
            .iter()
            .map(|w| {
                scope.spawn(move || {
                    w.barrier(BarrierGroup::Workers, WAIT)?;
                    w.barrier(BarrierGroup::All, WAIT)?;
                    w.barrier(BarrierGroup::Workers, WAIT)
                })
            })
            .collect();
        thread::sleep(Duration::from_millis(100));
        server.barrier(BarrierGroup::All, WAIT).unwrap();
        for r in runs {
            r.join().unwrap().unwrap();
        }
    });
    let err = server.barrier(BarrierGroup::Workers, WAIT).unwrap_err();
    assert!(matches!(err, ClientError::Invalid(_)), "{err}");
    for c in clients {
        c.leave("done").unwrap();
    }
    assert!(outcome(handle).failed.is_empty());
}

#[test]
fn a_crashed_worker_is_named_to_everyone_and_fails_a_blocked_barrier() {
    let (handle, addr) = start(3, 1);
    let mut clients = join_all(
        &addr,
        vec![
            reg(Role::Worker, Some(0), "w0", "a"),
            reg(Role::Worker, Some(1), "w1", "b"),
            reg(Role::Worker, Some(2), "crasher", "c"),
            reg(Role::Server, None, "s0", "d"),
        ],
    );
    let server = clients.pop().unwrap();
    let notices = server.failures();
    let crasher = clients.pop().unwrap();
    let started = Instant::now();
    thread::scope(|scope| {
        let blocked: Vec<_> = clients
            .iter()
            .map(|w| scope.spawn(move || w.barrier(BarrierGroup::Workers, Duration::from_secs(5))))
            .collect();
        thread::sleep(Duration::from_millis(100));
        drop(crasher);
        for b in blocked {
            let err = b.join().unwrap().unwrap_err();
            let (node, name, reason) = node_failed(&err);
            assert_eq!(
                node,
                NodeId {
                    role: Role::Worker,
                    rank: 2
                }
            );
            assert_eq!(name, "crasher");
            assert_eq!(reason, "connection closed without shutdown");
            assert!(
                err.to_string().contains("crasher (worker 2) failed"),
                "{err}"
            );
        }
    });
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "reported within the timeout"
    );
    let f = recv_failure(&notices);
    assert_eq!((f.name.as_str(), f.is_coordinator()), ("crasher", false));
    for w in &clients {
        assert_eq!(w.failed_nodes()[0].name, "crasher");
        let err = w.barrier(BarrierGroup::Workers, WAIT).unwrap_err();
        assert_eq!(
            node_failed(&err).1,
            "crasher",
            "already failed: fails at once"
        );
    }
    for w in clients {
        w.leave("done").unwrap();
    }
    assert!(server.wait_shutdown(WAIT));
    let out = outcome(handle);
    assert_eq!(out.failed.len(), 1);
    assert_eq!(out.failed[0].1, "crasher");
    assert_eq!(
        out.stop_reason,
        "no live workers remain: 2 finished, 1 failed"
    );
    server.leave("done").unwrap();
}

#[test]
fn a_client_without_the_job_token_is_refused() {
    let (handle, addr) = start(1, 0);
    let wrong = JobToken::new("not-the-coordinator-integration-token").unwrap();
    let err = CoordinatorClient::join(
        &addr,
        &wrong,
        reg(Role::Worker, None, "intruder", "x"),
        WAIT,
        opts(),
    )
    .expect_err("must be refused");
    assert_eq!(err.code(), ErrorCode::AuthFailed, "{err}");
    assert!(err.to_string().contains("intruder"), "{err}");
    handle.shutdown();
    assert!(outcome(handle).failed.is_empty());
}

#[test]
fn a_rank_already_taken_is_refused_naming_its_holder() {
    let (handle, addr) = start(2, 0);
    let first = thread::spawn({
        let addr = addr.clone();
        move || {
            CoordinatorClient::join(
                &addr,
                &token(),
                reg(Role::Worker, Some(1), "holder", "a"),
                WAIT,
                opts(),
            )
        }
    });
    thread::sleep(Duration::from_millis(100));
    let err = CoordinatorClient::join(
        &addr,
        &token(),
        reg(Role::Worker, Some(1), "usurper", "b"),
        WAIT,
        opts(),
    )
    .expect_err("duplicate rank");
    assert_eq!(err.code(), ErrorCode::DuplicateNode, "{err}");
    assert!(err.to_string().contains("'holder'"), "{err}");
    let other = CoordinatorClient::join(
        &addr,
        &token(),
        reg(Role::Worker, None, "other", "b"),
        WAIT,
        opts(),
    )
    .unwrap();
    let first = first.join().unwrap().unwrap();
    assert_eq!((first.rank(), other.rank()), (1, 0));
    first.leave("done").unwrap();
    other.leave("done").unwrap();
    assert!(outcome(handle).failed.is_empty());
}

#[test]
fn a_node_that_stops_heartbeating_is_declared_failed() {
    let (handle, addr) = start(1, 1);
    let worker = thread::spawn({
        let addr = addr.clone();
        move || {
            CoordinatorClient::join(
                &addr,
                &token(),
                reg(Role::Worker, None, "w0", "a"),
                WAIT,
                opts(),
            )
        }
    });
    let (_silent, mut reader) = raw_node(&addr, reg(Role::Server, None, "silent", "b"));
    let worker = worker.join().unwrap().unwrap();
    assert!(matches!(
        reader.read_owned().unwrap().0,
        Message::ClusterMap { your_rank: 0, .. }
    ));
    let notices = worker.failures();
    let started = Instant::now();
    let f = recv_failure(&notices);
    assert_eq!(
        f.node,
        NodeId {
            role: Role::Server,
            rank: 0
        }
    );
    assert_eq!(f.name, "silent");
    assert!(f.reason.starts_with("no heartbeat for"), "{}", f.reason);
    assert!(f.reason.contains("(timeout 0.50s)"), "{}", f.reason);
    assert!(started.elapsed() < Duration::from_millis(1500));
    // It is told why before the connection closes.
    match reader.read_owned().unwrap().0 {
        Message::Error(e) => assert_eq!(e.code, ErrorCode::Timeout),
        other => panic!("expected an Error, got {other:?}"),
    }
    worker.leave("done").unwrap();
    let out = outcome(handle);
    assert_eq!(out.failed.len(), 1);
    assert_eq!(out.failed[0].1, "silent");
}

#[test]
fn a_malformed_frame_is_answered_and_its_sender_reported() {
    let (handle, addr) = start(2, 0);
    let worker = thread::spawn({
        let addr = addr.clone();
        move || {
            CoordinatorClient::join(
                &addr,
                &token(),
                reg(Role::Worker, None, "w0", "a"),
                WAIT,
                opts(),
            )
        }
    });
    let (mut raw, mut reader) = raw_node(&addr, reg(Role::Worker, None, "garbler", "b"));
    let worker = worker.join().unwrap().unwrap();
    assert!(matches!(
        reader.read_owned().unwrap().0,
        Message::ClusterMap { .. }
    ));
    // A Heartbeat whose body is 3 bytes instead of 8.
    let mut frame = Message::Heartbeat { seq: 1 }.encode(0);
    frame.truncate(frame.len() - 5);
    frame[8..12].copy_from_slice(&3u32.to_le_bytes());
    std::io::Write::write_all(&mut raw, &frame).unwrap();
    match reader.read_owned().unwrap().0 {
        Message::Error(e) => {
            assert_eq!(e.code, ErrorCode::BadFrame);
            assert!(
                e.message.contains("Heartbeat frame truncated"),
                "{}",
                e.message
            );
        }
        other => panic!("expected an Error, got {other:?}"),
    }
    assert!(reader.read_owned().is_err(), "the connection is closed");
    let f = recv_failure(&worker.failures());
    assert_eq!(f.name, "garbler");
    assert!(f.reason.contains("sent an invalid frame"), "{}", f.reason);
    worker.leave("done").unwrap();
    assert_eq!(outcome(handle).failed.len(), 1);
}

#[test]
fn when_every_worker_leaves_servers_are_told_to_shut_down() {
    let (handle, addr) = start(2, 1);
    let mut clients = join_all(
        &addr,
        vec![
            reg(Role::Worker, None, "w0", "a"),
            reg(Role::Worker, None, "w1", "b"),
            reg(Role::Server, None, "s0", "a"),
        ],
    );
    let server = clients.pop().unwrap();
    let first = clients.pop().unwrap();
    first.leave("epoch done").unwrap();
    assert!(
        !server.wait_shutdown(Duration::from_millis(100)),
        "one worker remains"
    );
    clients.pop().unwrap().leave("epoch done").unwrap();
    assert!(server.wait_shutdown(WAIT));
    assert!(server.shutdown_requested());
    assert!(server.failed_nodes().is_empty());
    let out = outcome(handle);
    assert!(out.failed.is_empty(), "{:?}", out.failed);
    assert_eq!(out.stop_reason, "all workers finished");
    server.leave("done").unwrap();
}

#[test]
fn losing_the_coordinator_fails_barriers_and_is_announced() {
    // A stand-in coordinator that hands out a map and then goes silent.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let fake = thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        accept(&mut s, &token(), Service::Coordinator, WAIT, |_| Ok(())).unwrap();
        let mut reader = FrameReader::new(s.try_clone().unwrap(), DEFAULT_MAX_BODY);
        let Message::Register(r) = reader.read_owned().unwrap().0 else {
            panic!("expected Register")
        };
        let node = NodeInfo {
            rank: 0,
            host: r.host,
            port: r.port,
            host_id: r.host_id,
            pid: r.pid,
            link_mbit: r.link_mbit,
            name: r.name,
        };
        let map = ClusterMap {
            job_id: "fake".into(),
            workers: vec![node],
            servers: vec![],
        };
        write_message(&mut s, &Message::ClusterMap { your_rank: 0, map }).unwrap();
        // Keep the socket open but never answer, until the client gives up on us.
        while reader.read_owned().is_ok() {}
    });
    let c = CoordinatorClient::join(
        &addr,
        &token(),
        reg(Role::Worker, None, "w0", "a"),
        WAIT,
        opts(),
    )
    .unwrap();
    let notices = c.failures();
    let err = c.barrier(BarrierGroup::Workers, WAIT).unwrap_err();
    match &err {
        ClientError::PeerLost { peer, reason } => {
            assert_eq!(peer, &format!("coordinator at {addr}"));
            assert!(reason.starts_with("no reply for"), "{reason}");
        }
        other => panic!("expected PeerLost, got {other}"),
    }
    let f = recv_failure(&notices);
    assert!(f.is_coordinator());
    assert_eq!(f.name, format!("coordinator at {addr}"));
    assert!(c.leave("done").is_err(), "nobody to leave");
    fake.join().unwrap();
}

#[test]
fn every_node_sees_each_link_rate_stated_or_found() {
    let (handle, addr) = start(2, 1);
    let mut stated = reg(Role::Worker, Some(0), "w-stated", "a");
    stated.link_mbit = 25_000;
    let clients = join_all(
        &addr,
        vec![
            stated,
            // Left to the kernel: loopback reports no speed.
            reg(Role::Worker, Some(1), "w-found", "b"),
            reg(Role::Server, None, "s", "a"),
        ],
    );
    for c in &clients {
        let map = c.cluster_map();
        assert_eq!(map.workers[0].link_mbit, 25_000);
        assert_eq!(map.workers[1].link_mbit, 0);
        assert_eq!(map.servers[0].link_mbit, 0);
    }
    for c in clients {
        c.leave("done").unwrap();
    }
    drop(outcome(handle));
}
