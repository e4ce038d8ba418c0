//! Operators' metrics: a coordinator and a summation server started with a metrics
//! address serve Prometheus' text format that follows the job (nodes, bytes, rounds).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::thread;
use std::time::Duration;

use sumflow_client::coordinator::{CoordinatorClient, CoordinatorOptions};
use sumflow_client::{ServerClient, ServerOptions};
use sumflow_coordinator::{CoordinatorConfig, CoordinatorService};
use sumflow_summation::{CoordinatorLink, Membership, ServerConfig, SummationService};
use sumflow_wire::{Dtype, JobToken, Registration, Role};

fn token() -> JobToken {
    JobToken::new("metrics-test-token-abcdefghijkl").unwrap()
}

fn options() -> CoordinatorOptions {
    CoordinatorOptions {
        heartbeat_interval: Duration::from_millis(50),
        ..CoordinatorOptions::default()
    }
}

fn scrape(addr: SocketAddr) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: test\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200 OK"), "{out}");
    out
}

/// The value of the sample line that starts with `series` (name and labels).
fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {series} in\n{text}"))
        .parse()
        .unwrap()
}

#[test]
fn the_coordinator_and_a_server_serve_metrics_that_follow_the_job() {
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let mut cfg = CoordinatorConfig::new(any, 1, 1, token());
    cfg.metrics_bind = Some(any);
    let coord = CoordinatorService::start(cfg).unwrap();
    let coord_metrics = coord.metrics_addr().unwrap();
    let before = scrape(coord_metrics);
    assert_eq!(value(&before, "sumflow_coordinator_running"), 0.0);

    let addr = coord.local_addr().to_string();
    let server = {
        let addr = addr.clone();
        thread::spawn(move || {
            let mut cfg = ServerConfig::standalone(1, token());
            cfg.metrics_bind = Some(any);
            cfg.membership = Membership::Coordinator(CoordinatorLink {
                addr,
                advertise_host: "127.0.0.1".into(),
                host_id: "host-s".into(),
                requested_rank: None,
                join_timeout: Duration::from_secs(20),
                options: options(),
            });
            SummationService::start(cfg).unwrap()
        })
    };
    let reg = Registration {
        role: Role::Worker,
        requested_rank: Some(0),
        host: "127.0.0.1".into(),
        port: 0,
        host_id: "host-w".into(),
        pid: std::process::id(),
        link_mbit: 0,
        name: "trainer 0".into(),
    };
    let job =
        CoordinatorClient::join(&addr, &token(), reg, Duration::from_secs(20), options()).unwrap();
    let server = server.join().unwrap();
    let opts = ServerOptions {
        reply_timeout: Some(Duration::from_secs(10)),
        ..ServerOptions::default()
    };
    let s = &job.cluster_map().servers[0];
    let mut conn = ServerClient::connect(&s.addr(), &token(), 0, "trainer 0", &opts).unwrap();
    conn.init_key(7, Dtype::F32, 4 * 256, None).unwrap();
    for round in 1..=3 {
        conn.push_pull(7, round, Dtype::F32, &[0u8; 4 * 256])
            .unwrap();
    }

    let text = scrape(server.metrics_addr().unwrap());
    assert_eq!(value(&text, "sumflow_server_up"), 1.0);
    assert_eq!(value(&text, "sumflow_server_rounds_total"), 3.0);
    assert!(
        value(&text, "sumflow_server_received_bytes_total") >= 3.0 * 1024.0,
        "{text}"
    );
    assert!(
        value(&text, "sumflow_server_sent_bytes_total") >= 3.0 * 1024.0,
        "{text}"
    );
    assert_eq!(
        value(&text, "sumflow_server_workers{state=\"connected\"}"),
        1.0
    );
    assert_eq!(value(&text, "sumflow_server_keys"), 1.0);
    assert_eq!(value(&text, "sumflow_server_stalled_keys"), 0.0);

    let text = scrape(coord_metrics);
    assert_eq!(value(&text, "sumflow_coordinator_running"), 1.0);
    assert_eq!(
        value(
            &text,
            "sumflow_coordinator_nodes{role=\"worker\",status=\"live\"}"
        ),
        1.0
    );
    assert_eq!(
        value(
            &text,
            "sumflow_coordinator_nodes{role=\"server\",status=\"live\"}"
        ),
        1.0
    );

    conn.shutdown("done").unwrap();
    job.leave("done").unwrap();
    let outcome = coord.wait().unwrap();
    assert!(outcome.failed.is_empty(), "{:?}", outcome.failed);
    while !server.is_finished() {
        thread::sleep(Duration::from_millis(20));
    }
    server.wait();
}
