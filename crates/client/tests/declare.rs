//! Tensor declarations through a real coordinator on 127.0.0.1: workers agree on every
//! name -> id pair whatever order they declare in, and a disagreement reaches every worker.
//! Every wait is bounded so a regression fails instead of hanging.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::sync::Barrier;
use std::thread;
use std::time::{Duration, Instant};

use sumflow_client::coordinator::{CoordinatorClient, CoordinatorOptions};
use sumflow_client::ClientError;
use sumflow_coordinator::{CoordinatorConfig, CoordinatorHandle, CoordinatorService, JobOutcome};
use sumflow_wire::io::{accept, write_message, FrameReader};
use sumflow_wire::{
    BarrierGroup, ClusterMap, Dtype, ErrorCode, JobToken, Message, NodeInfo, Registration, Role,
    Service, DEFAULT_MAX_BODY,
};

const HEARTBEAT_TIMEOUT: Duration = Duration::from_millis(500);
const WAIT: Duration = Duration::from_secs(3);
const TENSORS: usize = 50;
const THREADS_PER_WORKER: usize = 4;

fn token() -> JobToken {
    JobToken::new("declaration-integration-test-token").unwrap()
}

fn start(workers: u32, servers: u32) -> (CoordinatorHandle, String) {
    let mut cfg = CoordinatorConfig::new("127.0.0.1:0".parse().unwrap(), workers, servers, token());
    cfg.heartbeat_timeout = HEARTBEAT_TIMEOUT;
    cfg.join_timeout = Duration::from_secs(5);
    cfg.job_id = "declare-test".into();
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

fn reg(role: Role, rank: u32) -> Registration {
    let name = match role {
        Role::Worker => format!("trainer-{rank}"),
        Role::Server => format!("summer-{rank}"),
    };
    Registration {
        role,
        requested_rank: Some(rank),
        host: "127.0.0.1".into(),
        port: 7000,
        host_id: format!("machine-{rank}"),
        pid: std::process::id(),
        link_mbit: 0,
        name,
    }
}

/// Joins `workers` workers (ranks 0..) and `servers` servers, each from its own thread as
/// separate processes would; returns them in that order.
fn join_job(addr: &str, workers: u32, servers: u32) -> Vec<CoordinatorClient> {
    let regs = (0..workers)
        .map(|r| reg(Role::Worker, r))
        .chain((0..servers).map(|r| reg(Role::Server, r)));
    let threads: Vec<_> = regs
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

fn leave_all(clients: Vec<CoordinatorClient>) {
    for c in clients {
        c.leave("done").unwrap();
    }
}

/// A deterministic xorshift generator, so a failing order can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = (self.next() % (i as u64 + 1)) as usize;
            items.swap(i, j);
        }
    }
}

/// The model every worker declares: name, dtype and element count of each tensor.
fn model() -> Vec<(String, Dtype, u64)> {
    (0..TENSORS)
        .map(|i| {
            let kind = if i % 2 == 0 { "weight" } else { "bias" };
            let dtype = Dtype::ALL[i % Dtype::ALL.len()];
            (format!("layer{}.{kind}", i / 2), dtype, 1 + 37 * i as u64)
        })
        .collect()
}

/// Declares `tensors` from several threads at once (each takes every n-th one) and
/// returns the name -> id map they were answered with.
fn declare_from_threads(
    client: &CoordinatorClient,
    tensors: &[(String, Dtype, u64)],
) -> BTreeMap<String, u32> {
    thread::scope(|scope| {
        let runs: Vec<_> = (0..THREADS_PER_WORKER)
            .map(|t| {
                scope.spawn(move || {
                    let mine = tensors.iter().skip(t).step_by(THREADS_PER_WORKER);
                    mine.map(|(name, dtype, elements)| {
                        let id = client.declare(name, *dtype, *elements, WAIT);
                        (
                            name.clone(),
                            id.unwrap_or_else(|e| panic!("declare {name}: {e}")),
                        )
                    })
                    .collect::<Vec<_>>()
                })
            })
            .collect();
        runs.into_iter().flat_map(|r| r.join().unwrap()).collect()
    })
}

#[test]
fn workers_declaring_in_different_orders_from_several_threads_agree_on_every_id() {
    let (handle, addr) = start(3, 1);
    let clients = join_job(&addr, 3, 1);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let orders: Vec<Vec<(String, Dtype, u64)>> = (0..3)
        .map(|_| {
            let mut order = model();
            rng.shuffle(&mut order);
            order
        })
        .collect();
    assert!(
        orders[0] != orders[1] && orders[1] != orders[2],
        "the orders differ"
    );
    let maps: Vec<BTreeMap<String, u32>> = thread::scope(|scope| {
        let runs: Vec<_> = clients[..3]
            .iter()
            .zip(&orders)
            .map(|(c, order)| scope.spawn(move || declare_from_threads(c, order)))
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    assert_eq!(maps[0].len(), TENSORS);
    assert_eq!(maps[0], maps[1], "workers 0 and 1 disagree");
    assert_eq!(maps[0], maps[2], "workers 0 and 2 disagree");
    let mut ids: Vec<u32> = maps[0].values().copied().collect();
    ids.sort();
    assert_eq!(
        ids,
        (0..TENSORS as u32).collect::<Vec<_>>(),
        "ids are dense"
    );
    // Declaring again answers the same id, from the client's own table.
    let (name, dtype, elements) = &orders[1][7];
    assert_eq!(
        clients[1].declare(name, *dtype, *elements, WAIT).unwrap(),
        maps[0][name]
    );
    assert!(clients.iter().all(|c| c.job_error().is_none()));
    leave_all(clients);
    assert!(outcome(handle).failed.is_empty());
}

/// Polls until `client` has heard of the job's fatal error, or `WAIT` passes.
fn wait_job_error(client: &CoordinatorClient) -> String {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(e) = client.job_error() {
            return e.message;
        }
        assert!(
            Instant::now() < deadline,
            "no job error reached rank {}",
            client.rank()
        );
        thread::sleep(Duration::from_millis(5));
    }
}

/// The message of a `KeyMismatch` refusal; anything else fails the test.
fn mismatch(result: Result<impl std::fmt::Debug, ClientError>) -> String {
    match result {
        Err(ClientError::Remote {
            code: ErrorCode::KeyMismatch,
            key: None,
            message,
            ..
        }) => message,
        other => panic!("expected a KeyMismatch refusal, got {other:?}"),
    }
}

/// Worker 0 declares `fc.weight` as `first`; worker 2 then declares it as `second` while
/// worker 1 waits in a barrier. Every worker must hear the same error, which must contain
/// each of `expected`; later declarations and barriers must fail with it too.
fn disagreement_reaches_every_worker(first: (Dtype, u64), second: (Dtype, u64), expected: &[&str]) {
    let (handle, addr) = start(3, 1);
    let clients = join_job(&addr, 3, 1);
    let (w0, w1, w2) = (&clients[0], &clients[1], &clients[2]);
    let id = w0.declare("fc.weight", first.0, first.1, WAIT).unwrap();
    let started = Instant::now();
    let message = thread::scope(|scope| {
        let blocked = scope.spawn(|| w1.barrier(BarrierGroup::Workers, Duration::from_secs(10)));
        thread::sleep(Duration::from_millis(50));
        let message = mismatch(w2.declare("fc.weight", second.0, second.1, WAIT));
        assert_eq!(
            mismatch(blocked.join().unwrap()),
            message,
            "the waiting barrier fails"
        );
        message
    });
    for part in expected {
        assert!(message.contains(part), "{part:?} not in {message}");
    }
    for w in [w0, w1, w2] {
        assert_eq!(wait_job_error(w), message, "rank {}", w.rank());
    }
    assert!(
        started.elapsed() < WAIT,
        "every worker heard within the timeout"
    );
    assert!(clients[3].job_error().is_none(), "servers do not declare");
    // Later declarations fail the same way, whether new, agreeing or already answered.
    assert_eq!(
        mismatch(w0.declare("fc.bias", Dtype::F32, 10, WAIT)),
        message
    );
    assert_eq!(
        mismatch(w1.declare("fc.weight", first.0, first.1, WAIT)),
        message
    );
    assert_eq!(
        mismatch(w0.declare("fc.weight", first.0, first.1, WAIT)),
        message
    );
    assert_eq!(mismatch(w2.barrier(BarrierGroup::Workers, WAIT)), message);
    assert_eq!(id, 0);
    leave_all(clients);
    assert!(
        outcome(handle).failed.is_empty(),
        "nobody crashed; the workers left"
    );
}

#[test]
fn a_size_mismatch_reaches_every_worker_naming_the_tensor_and_both_workers() {
    disagreement_reaches_every_worker(
        (Dtype::F32, 1000),
        (Dtype::F32, 1024),
        &[
            "tensor 'fc.weight' declared as f32 x 1024 by worker 2 'trainer-2'",
            "but as f32 x 1000 by worker 0 'trainer-0'",
            "every worker must declare each tensor with the same dtype and size",
        ],
    );
}

#[test]
fn a_dtype_mismatch_reaches_every_worker_naming_the_tensor_and_both_workers() {
    disagreement_reaches_every_worker(
        (Dtype::F32, 1000),
        (Dtype::Bf16, 1000),
        &[
            "tensor 'fc.weight' declared as bf16 x 1000 by worker 2 'trainer-2'",
            "but as f32 x 1000 by worker 0 'trainer-0'",
        ],
    );
}

#[test]
fn a_worker_that_disagrees_with_itself_is_caught_too() {
    let (handle, addr) = start(2, 0);
    let clients = join_job(&addr, 2, 0);
    let start_line = Barrier::new(2);
    let results: Vec<Result<u32, ClientError>> = thread::scope(|scope| {
        let runs: Vec<_> = [4, 8]
            .map(|elements| {
                let (c, line) = (&clients[0], &start_line);
                scope.spawn(move || {
                    line.wait();
                    c.declare("emb.weight", Dtype::F16, elements, WAIT)
                })
            })
            .into_iter()
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    // Whichever declaration the coordinator saw second is refused; the first may have been
    // answered before the second was sent, but never after.
    let refused: Vec<String> = results
        .into_iter()
        .filter(|r| r.is_err())
        .map(mismatch)
        .collect();
    assert!(!refused.is_empty(), "the disagreement went unnoticed");
    let message = wait_job_error(&clients[1]);
    assert!(
        refused.iter().all(|m| *m == message),
        "{refused:?} vs {message}"
    );
    assert!(
        message.contains("tensor 'emb.weight'")
            && message.matches("worker 0 'trainer-0'").count() == 2,
        "{message}"
    );
    leave_all(clients);
    assert!(outcome(handle).failed.is_empty());
}

#[test]
fn declarations_the_coordinator_could_never_accept_are_refused_before_sending() {
    let (handle, addr) = start(1, 1);
    let clients = join_job(&addr, 1, 1);
    let (worker, server) = (&clients[0], &clients[1]);
    let invalid = |r: Result<u32, ClientError>| match r {
        Err(ClientError::Invalid(why)) => why,
        other => panic!("expected an invalid argument, got {other:?}"),
    };
    let why = invalid(server.declare("fc.weight", Dtype::F32, 4, WAIT));
    assert!(
        why.contains("a server does not declare tensors (tensor 'fc.weight')"),
        "{why}"
    );
    assert!(invalid(worker.declare("", Dtype::F32, 4, WAIT)).contains("must not be empty"));
    let why = invalid(worker.declare("fc.bias", Dtype::F32, 0, WAIT));
    assert!(
        why.contains("tensor 'fc.bias' must have at least one element"),
        "{why}"
    );
    let long = "x".repeat(5000);
    assert!(invalid(worker.declare(&long, Dtype::F32, 4, WAIT)).contains("5000 bytes"));
    assert!(invalid(worker.declare("huge", Dtype::F64, u64::MAX / 4, WAIT)).contains("2^64"));
    // None of that reached the coordinator: the table is still empty.
    assert_eq!(worker.declare("fc.weight", Dtype::F32, 4, WAIT).unwrap(), 0);
    leave_all(clients);
    assert!(outcome(handle).failed.is_empty());
}

#[test]
fn a_declaration_left_unanswered_times_out_naming_the_tensor() {
    // A stand-in coordinator that hands out a map, acknowledges heartbeats and ignores
    // everything else.
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
        let mut declares = 0;
        while let Ok((msg, _)) = reader.read_owned() {
            match msg {
                Message::Heartbeat { seq } => {
                    let _ = write_message(&mut s, &Message::HeartbeatAck { seq });
                }
                Message::Declare { .. } => declares += 1,
                _ => break,
            }
        }
        declares
    });
    let c = CoordinatorClient::join(&addr, &token(), reg(Role::Worker, 0), WAIT, opts()).unwrap();
    let wait = Duration::from_millis(200);
    let (a, b) = thread::scope(|scope| {
        let a = scope.spawn(|| c.declare("fc.weight", Dtype::F32, 10, wait));
        let b = scope.spawn(|| c.declare("fc.weight", Dtype::F32, 10, wait));
        (a.join().unwrap(), b.join().unwrap())
    });
    for r in [a, b] {
        match r {
            Err(ClientError::Timeout { what, secs }) => {
                assert_eq!(secs, 0.2);
                assert!(
                    what.contains("to assign an id to tensor 'fc.weight' (f32 x 10)"),
                    "{what}"
                );
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
    }
    c.leave("done").unwrap();
    assert_eq!(
        fake.join().unwrap(),
        1,
        "one Declare for one name, however many callers"
    );
}
