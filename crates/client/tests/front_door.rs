//! The front door of summation servers and coordinators under connections that never
//! authenticate: those in their handshake are capped on their own, and a real node gets
//! in as soon as they are gone.

use std::io::Read;
use std::net::TcpStream;
use std::thread;
use std::time::{Duration, Instant};

use sumflow_client::coordinator::{CoordinatorClient, CoordinatorOptions};
use sumflow_client::{ServerClient, ServerOptions};
use sumflow_coordinator::{CoordinatorConfig, CoordinatorService};
use sumflow_summation::{ServerConfig, SummationService};
use sumflow_wire::gate::MAX_HANDSHAKES;
use sumflow_wire::io::{FrameReader, HANDSHAKE_MAX_BODY};
use sumflow_wire::{JobToken, Message, Registration, Role, DEFAULT_MAX_BODY};

fn token() -> JobToken {
    JobToken::new("front-door-test-token-0123456789").unwrap()
}

/// A connection that reads the server's Challenge and then says nothing.
fn silent(addr: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let (msg, _) = FrameReader::new(&mut s, HANDSHAKE_MAX_BODY)
        .read_owned()
        .unwrap();
    assert!(matches!(msg, Message::Challenge { .. }), "{msg:?}");
    s
}

/// One more connection is closed at once, before any Challenge.
fn turned_away(addr: &str) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let started = Instant::now();
    let mut buf = [0u8; 64];
    let n = s.read(&mut buf).unwrap_or(0);
    assert_eq!(n, 0, "a connection past the handshake cap got {n} bytes");
    assert!(started.elapsed() < Duration::from_secs(2));
}

/// Retries `f` until it succeeds (the server frees a place once it sees a silent
/// connection close), for at most a few seconds.
fn eventually<T, E: std::fmt::Debug>(mut f: impl FnMut() -> Result<T, E>) -> T {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match f() {
            Ok(v) => return v,
            Err(e) if Instant::now() > deadline => panic!("still refused: {e:?}"),
            Err(_) => thread::sleep(Duration::from_millis(50)),
        }
    }
}

#[test]
fn a_summation_server_caps_unauthenticated_connections_and_then_admits_its_worker() {
    let h = SummationService::start(ServerConfig::standalone(1, token())).unwrap();
    let addr = h.local_addr().to_string();
    let held: Vec<TcpStream> = (0..MAX_HANDSHAKES).map(|_| silent(&addr)).collect();
    turned_away(&addr);
    drop(held);
    let opts = ServerOptions {
        connect_timeout: Duration::from_secs(2),
        reply_timeout: Some(Duration::from_secs(5)),
        max_body: 1 << 20,
        // Over TCP: the cap is the TCP door's here.
        machine_local: false,
        mailbox: false,
    };
    let worker = eventually(|| ServerClient::connect(&addr, &token(), 0, "worker 0", &opts));
    drop(worker);
    h.shutdown();
    h.wait();
}

#[test]
fn a_coordinator_caps_unauthenticated_connections_and_then_admits_its_nodes() {
    let mut cfg = CoordinatorConfig::new("127.0.0.1:0".parse().unwrap(), 1, 0, token());
    cfg.join_timeout = Duration::from_secs(20);
    let handle = CoordinatorService::start(cfg).unwrap();
    let addr = handle.local_addr().to_string();
    let held: Vec<TcpStream> = (0..MAX_HANDSHAKES).map(|_| silent(&addr)).collect();
    turned_away(&addr);
    drop(held);
    let reg = Registration {
        role: Role::Worker,
        requested_rank: Some(0),
        host: "127.0.0.1".into(),
        port: 7000,
        host_id: "h0".into(),
        pid: std::process::id(),
        link_mbit: 0,
        name: "worker 0".into(),
    };
    let opts = CoordinatorOptions {
        heartbeat_interval: Duration::from_millis(50),
        heartbeat_timeout: Duration::from_secs(5),
        connect_timeout: Duration::from_secs(2),
        max_body: DEFAULT_MAX_BODY,
    };
    let client = eventually(|| {
        CoordinatorClient::join(
            &addr,
            &token(),
            reg.clone(),
            Duration::from_secs(5),
            opts.clone(),
        )
    });
    assert_eq!(client.rank(), 0);
}
