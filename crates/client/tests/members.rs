//! Keys whose rounds count only some workers (their members), over real TCP on 127.0.0.1.

use std::thread;
use std::time::Duration;

use sumflow_client::{ClientError, Reply, ServerClient, ServerOptions};
use sumflow_summation::{ServerConfig, ServerHandle, SummationService};
use sumflow_wire::{Dtype, ErrorCode, JobToken};

fn token() -> JobToken {
    JobToken::new("members-test-token-0123456789").unwrap()
}

fn start(workers: u32) -> (ServerHandle, String) {
    let h = SummationService::start(ServerConfig::standalone(workers, token())).unwrap();
    let addr = h.local_addr().to_string();
    (h, addr)
}

fn worker(addr: &str, rank: u32) -> ServerClient {
    let opts = ServerOptions {
        connect_timeout: Duration::from_secs(5),
        reply_timeout: Some(Duration::from_secs(10)),
        ..ServerOptions::default()
    };
    ServerClient::connect(addr, &token(), rank, &format!("w{rank}"), &opts).unwrap()
}

fn stop(h: ServerHandle) {
    h.shutdown();
    h.wait();
}

fn i32s(vals: &[i32]) -> Vec<u8> {
    vals.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn expect_refused(err: ClientError, code: ErrorCode, needles: &[&str]) {
    let ClientError::Remote {
        code: c, message, ..
    } = &err
    else {
        panic!("expected a {code} refusal, got {err}");
    };
    assert_eq!(*c, code, "{err}");
    for needle in needles {
        assert!(message.contains(needle), "'{message}' lacks '{needle}'");
    }
}

const MEMBER_KEY: u64 = 7;
const EVERYONE: u64 = 8;

#[test]
fn a_member_key_sums_its_members_only_and_refuses_the_others() {
    let (h, addr) = start(3);
    let mut w: Vec<ServerClient> = (0..3).map(|r| worker(&addr, r)).collect();
    for c in &mut w {
        c.init_key(EVERYONE, Dtype::I32, 8, None).unwrap();
    }
    // Only the members declare it (worker 1 could too: declaring is not pushing).
    for r in [0, 2] {
        w[r].init_member_key(MEMBER_KEY, Dtype::I32, 8, &[0, 2])
            .unwrap();
    }
    // Rounds of the member key complete with workers 0 and 2 alone, while the key of
    // every worker waits for worker 1.
    w[0].tx
        .push(EVERYONE, 1, Dtype::I32, &i32s(&[1, 1]))
        .unwrap();
    w[2].tx
        .push(EVERYONE, 1, Dtype::I32, &i32s(&[1, 1]))
        .unwrap();
    for round in 1..=3 {
        w[2].tx
            .push(MEMBER_KEY, round, Dtype::I32, &i32s(&[10, 20]))
            .unwrap();
        let a = w[0]
            .push_pull(MEMBER_KEY, round, Dtype::I32, &i32s(&[round as i32, 1]))
            .unwrap();
        let b = w[2].pull(MEMBER_KEY, round).unwrap();
        assert_eq!(a.data, i32s(&[10 + round as i32, 21]));
        assert_eq!(b.data, a.data);
    }
    let mut w0 = w.remove(0);
    w0.tx.pull(EVERYONE, 1, true).unwrap();
    let waiting = thread::spawn(move || (w0.rx.recv(), w0));
    thread::sleep(Duration::from_millis(200));
    assert!(
        !waiting.is_finished(),
        "the key of every worker waits for worker 1"
    );
    let sum = w[0].push_pull(EVERYONE, 1, Dtype::I32, &[0; 8]).unwrap();
    assert_eq!(sum.data, i32s(&[2, 2]));
    let (got, w0) = waiting.join().unwrap();
    assert!(matches!(got.unwrap(), Reply::Sum(p) if p.data == i32s(&[2, 2])));
    let mut w2 = w.pop().unwrap();
    let mut w1 = w.pop().unwrap();
    let mut w0 = w0;
    w2.pull(EVERYONE, 1).unwrap();

    // Worker 1 is no member: its push is refused, naming it and the members.
    let e = w1
        .push_pull(MEMBER_KEY, 1, Dtype::I32, &i32s(&[100, 100]))
        .unwrap_err();
    expect_refused(
        e,
        ErrorCode::BadRank,
        &["key 7", "worker 1 sent push", "workers [0, 2]"],
    );
    drop(w1);
    // Refused, worker 1 is gone: the member key goes on, the other key cannot.
    w2.tx
        .push(MEMBER_KEY, 4, Dtype::I32, &i32s(&[2, 2]))
        .unwrap();
    let a = w0
        .push_pull(MEMBER_KEY, 4, Dtype::I32, &i32s(&[1, 1]))
        .unwrap();
    assert_eq!(
        a.data,
        i32s(&[3, 3]),
        "worker 1's refused push is summed nowhere"
    );
    assert_eq!(w2.pull(MEMBER_KEY, 4).unwrap().data, a.data);
    let e = w0
        .push_pull(EVERYONE, 2, Dtype::I32, &i32s(&[1, 1]))
        .unwrap_err();
    expect_refused(e, ErrorCode::NodeFailed, &["round 2 of key 8", "worker 1"]);
    stop(h);
}

#[test]
fn member_lists_must_agree_and_name_workers_of_the_job() {
    let (h, addr) = start(3);
    let mut a = worker(&addr, 0);
    let mut b = worker(&addr, 2);
    let mut c = worker(&addr, 1);
    a.init_member_key(1, Dtype::F32, 16, &[0, 2]).unwrap();
    let e = b
        .init_member_key(1, Dtype::F32, 16, &[0, 1, 2])
        .unwrap_err();
    expect_refused(
        e,
        ErrorCode::KeyMismatch,
        &["with members [0, 1, 2]", "with members [0, 2]"],
    );
    let e = c.init_member_key(2, Dtype::F32, 16, &[1, 3]).unwrap_err();
    expect_refused(
        e,
        ErrorCode::BadRank,
        &["key 2 names worker 3", "workers 0..3"],
    );
    // A key of every worker cannot become a member key either.
    let mut d = worker(&addr, 0);
    d.init_key(3, Dtype::F32, 16, None).unwrap();
    let e = d.init_member_key(3, Dtype::F32, 16, &[0]).unwrap_err();
    expect_refused(e, ErrorCode::KeyMismatch, &["for every worker"]);
    stop(h);
}
