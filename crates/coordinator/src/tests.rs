//! The pure core driven with fabricated instants: no sockets, no threads, no sleeping.

use std::time::{Duration, Instant};

use sumflow_wire::{
    BarrierGroup, ClusterMap, Dtype, ErrorCode, ErrorReply, JobToken, Message, NodeId, Peer,
    Registration, Role, WireError,
};

use crate::config::CoordinatorConfig;
use crate::liveness::silence_verdict;
use crate::membership::{Action, ConnId, Incident, IncidentKind, Membership};
use crate::ranks::{admit, assign_ranks};
use crate::{CoordinatorError, JobOutcome};

const W: Role = Role::Worker;
const S: Role = Role::Server;

fn cfg(workers: u32, servers: u32) -> CoordinatorConfig {
    let token = JobToken::new("0123456789abcdef-unit-test").unwrap();
    let mut c = CoordinatorConfig::new("127.0.0.1:0".parse().unwrap(), workers, servers, token);
    c.heartbeat_timeout = Duration::from_secs(3);
    c.join_timeout = Duration::from_secs(60);
    c.job_id = "job-test".into();
    c
}

fn reg(role: Role, rank: Option<u32>, name: &str, host_id: &str) -> Registration {
    Registration {
        role,
        requested_rank: rank,
        host: "10.0.0.1".into(),
        port: 9000,
        host_id: host_id.into(),
        pid: 42,
        link_mbit: 0,
        name: name.into(),
    }
}

struct Harness {
    m: Membership,
    t0: Instant,
}

impl Harness {
    fn new(c: &CoordinatorConfig) -> Harness {
        let t0 = Instant::now();
        Harness {
            m: Membership::new(c, t0),
            t0,
        }
    }

    fn at(&self, ms: u64) -> Instant {
        self.t0 + Duration::from_millis(ms)
    }

    /// Handshake and registration of `r` on `conn` at `ms`.
    fn join(&mut self, conn: ConnId, r: Registration, ms: u64) -> Vec<Action> {
        let peer = Peer {
            role: r.role,
            rank: r.requested_rank,
            name: r.name.clone(),
        };
        let mut out = self.m.connected(conn, peer, self.at(ms));
        out.extend(self.m.message(conn, Message::Register(r), self.at(ms)));
        out
    }

    fn send(&mut self, conn: ConnId, msg: Message, ms: u64) -> Vec<Action> {
        self.m.message(conn, msg, self.at(ms))
    }

    /// Joins workers on conns 1.. (names w0, w1, ...) and servers on conns 101.. (s0, ...),
    /// each on its own host, all at time 0; returns the actions of the last join.
    fn running(c: &CoordinatorConfig) -> (Harness, Vec<Action>) {
        let mut h = Harness::new(c);
        let mut last = Vec::new();
        for i in 0..c.num_workers {
            last = h.join(
                1 + i as u64,
                reg(W, None, &format!("w{i}"), &format!("h{i}")),
                0,
            );
        }
        for i in 0..c.num_servers {
            last = h.join(
                101 + i as u64,
                reg(S, None, &format!("s{i}"), &format!("h{i}")),
                0,
            );
        }
        (h, last)
    }
}

fn sent(actions: &[Action], conn: ConnId) -> Vec<&Message> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Send(c, m) if *c == conn => Some(m),
            _ => None,
        })
        .collect()
}

fn closed(actions: &[Action], conn: ConnId) -> bool {
    actions
        .iter()
        .any(|a| matches!(a, Action::Close(c) if *c == conn))
}

fn errors(actions: &[Action], conn: ConnId) -> Vec<&ErrorReply> {
    sent(actions, conn)
        .into_iter()
        .filter_map(|m| match m {
            Message::Error(e) => Some(e),
            _ => None,
        })
        .collect()
}

fn map_for(actions: &[Action], conn: ConnId) -> Option<(u32, ClusterMap)> {
    sent(actions, conn).into_iter().find_map(|m| match m {
        Message::ClusterMap { your_rank, map } => Some((*your_rank, map.clone())),
        _ => None,
    })
}

fn failures(actions: &[Action], conn: ConnId) -> Vec<(NodeId, String, String)> {
    sent(actions, conn)
        .into_iter()
        .filter_map(|m| match m {
            Message::NodeFailed { node, name, reason } => {
                Some((*node, name.clone(), reason.clone()))
            }
            _ => None,
        })
        .collect()
}

fn outcome(actions: &[Action]) -> Option<&Result<JobOutcome, CoordinatorError>> {
    actions.iter().find_map(|a| match a {
        Action::Finished(r) => Some(r),
        _ => None,
    })
}

fn logs(actions: &[Action]) -> String {
    let lines: Vec<&str> = actions
        .iter()
        .filter_map(|a| match a {
            Action::Log(_, l) => Some(l.as_str()),
            _ => None,
        })
        .collect();
    lines.join("\n")
}

fn incidents(actions: &[Action]) -> Vec<&Incident> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Incident(i) => Some(i),
            _ => None,
        })
        .collect()
}

fn barrier(id: u64, group: BarrierGroup) -> Message {
    Message::Barrier { id, group }
}

fn worker(rank: u32) -> NodeId {
    NodeId { role: W, rank }
}

fn declare(name: &str, dtype: Dtype, elements: u64) -> Message {
    Message::Declare {
        name: name.into(),
        dtype,
        elements,
        compression: String::new(),
    }
}

/// The tensor id `conn` was answered with for `name`.
fn declared(actions: &[Action], conn: ConnId, name: &str) -> Option<u32> {
    sent(actions, conn).into_iter().find_map(|m| match m {
        Message::Declared { name: n, tensor_id } if n == name => Some(*tensor_id),
        _ => None,
    })
}

/// Worker `conn`'s declarations in order, answered one by one: name -> id.
fn declare_all(h: &mut Harness, conn: ConnId, names: &[String], ms: u64) -> Vec<(String, u32)> {
    names
        .iter()
        .map(|n| {
            let a = h.send(conn, declare(n, Dtype::F32, 10), ms);
            let id = declared(&a, conn, n).unwrap_or_else(|| panic!("no id for {n}: {a:?}"));
            (n.clone(), id)
        })
        .collect()
}

#[test]
fn requested_ranks_are_honoured_and_the_rest_fill_the_lowest_free_in_join_order() {
    assert_eq!(
        assign_ranks(&[None, Some(0), None, Some(2), None]),
        vec![1, 0, 3, 2, 4]
    );
    assert_eq!(assign_ranks(&[Some(1), Some(0)]), vec![1, 0]);
    assert_eq!(assign_ranks(&[]), Vec::<u32>::new());
}

#[test]
fn admission_refuses_bad_duplicate_and_surplus_ranks_naming_them() {
    let a = reg(W, Some(1), "alpha", "ha");
    let e = admit(&reg(W, Some(2), "beta", "hb"), &[], 2).unwrap_err();
    assert_eq!(e.code, ErrorCode::BadRank);
    assert!(
        e.message.contains("'beta' asked for rank 2"),
        "{}",
        e.message
    );
    assert!(e.message.contains("ranks 0 to 1"), "{}", e.message);

    let e = admit(&reg(W, Some(1), "beta", "hb"), &[&a], 2).unwrap_err();
    assert_eq!(e.code, ErrorCode::DuplicateNode);
    assert!(
        e.message.contains("already held by 'alpha' (pid 42 on ha)"),
        "{}",
        e.message
    );

    let b = reg(W, None, "beta", "hb");
    let e = admit(&reg(W, None, "gamma", "hc"), &[&a, &b], 2).unwrap_err();
    assert_eq!(e.code, ErrorCode::ClusterFull);
    assert!(e.message.contains("'alpha', 'beta'"), "{}", e.message);
    assert!(
        e.message.contains("'gamma' is one too many"),
        "{}",
        e.message
    );

    assert!(admit(&reg(W, None, "gamma", "hc"), &[&a], 2).is_ok());
    let e = admit(&reg(S, None, "s", "h"), &[], 0).unwrap_err();
    assert_eq!(e.code, ErrorCode::ClusterFull);
}

#[test]
fn the_map_goes_out_once_everyone_joined_identical_for_all() {
    let c = cfg(3, 2);
    let mut h = Harness::new(&c);
    let mut a = h.join(1, reg(W, None, "w-a", "host-a"), 0);
    a.extend(h.join(2, reg(W, Some(0), "w-b", "host-b"), 1));
    a.extend(h.join(3, reg(W, None, "w-c", "host-c"), 2));
    a.extend(h.join(11, reg(S, None, "s-a", "host-a"), 3));
    assert!(
        (1..=3).all(|c| map_for(&a, c).is_none()),
        "no map before all joined"
    );
    let last = h.join(12, reg(S, Some(0), "s-cpu", "cpu"), 4);
    let (r1, map) = map_for(&last, 1).unwrap();
    let names: Vec<&str> = map.workers.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["w-b", "w-a", "w-c"]);
    let names: Vec<&str> = map.servers.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["s-cpu", "s-a"]);
    assert_eq!(r1, 1);
    assert_eq!(map.job_id, "job-test");
    for (conn, rank) in [(2, 0), (3, 2), (11, 1), (12, 0)] {
        let (r, m) = map_for(&last, conn).unwrap();
        assert_eq!((r, &m), (rank, &map), "conn {conn}");
    }
    assert_eq!(map.colocated_servers(1), vec![1]);
    assert_eq!(map.cpu_only_servers(), vec![0]);
    assert!(
        logs(&last).contains("all 5 nodes joined"),
        "{}",
        logs(&last)
    );
}

#[test]
fn conflicting_or_surplus_registrations_are_refused_and_closed() {
    let c = cfg(2, 1);
    let mut h = Harness::new(&c);
    h.join(1, reg(W, Some(1), "alpha", "ha"), 0);
    let a = h.join(2, reg(W, Some(1), "beta", "hb"), 1);
    let e = errors(&a, 2);
    assert_eq!(e[0].code, ErrorCode::DuplicateNode);
    assert!(e[0].message.contains("'alpha'"), "{}", e[0].message);
    assert!(closed(&a, 2));

    let a = h.join(3, reg(W, Some(5), "gamma", "hc"), 2);
    assert_eq!(errors(&a, 3)[0].code, ErrorCode::BadRank);
    assert!(closed(&a, 3));

    // Authenticated as rank 0, registering for any rank: the identities disagree.
    h.m.connected(
        4,
        Peer {
            role: W,
            rank: Some(0),
            name: "delta".into(),
        },
        h.at(3),
    );
    let a = h.send(4, Message::Register(reg(W, None, "delta", "hd")), 3);
    assert_eq!(errors(&a, 4)[0].code, ErrorCode::BadRank);

    h.join(5, reg(W, None, "eps", "he"), 4);
    let a = h.join(6, reg(W, None, "zeta", "hf"), 5);
    assert_eq!(errors(&a, 6)[0].code, ErrorCode::ClusterFull);

    let a = h.send(5, Message::Register(reg(W, None, "eps", "he")), 6);
    assert_eq!(errors(&a, 5)[0].code, ErrorCode::UnexpectedOp);
    assert!(errors(&a, 5)[0].message.contains("already registered"));
    assert!(!closed(&a, 5), "a repeated Register is refused, not fatal");

    let a = h.join(7, reg(S, None, "srv", "hs"), 7);
    assert!(map_for(&a, 7).is_some());
    let a = h.join(8, reg(S, None, "late", "hl"), 8);
    let e = errors(&a, 8);
    assert_eq!(e[0].code, ErrorCode::ClusterFull);
    assert!(e[0].message.contains("running job"), "{}", e[0].message);
}

#[test]
fn a_node_leaving_before_the_map_frees_its_rank_for_a_replacement() {
    let c = cfg(2, 0);
    let mut h = Harness::new(&c);
    h.join(1, reg(W, Some(0), "first", "ha"), 0);
    let a = h.m.disconnected(1, "connection closed without shutdown");
    assert!(logs(&a).contains("a replacement may join"), "{}", logs(&a));
    assert!(outcome(&a).is_none());
    let a = h.join(2, reg(W, Some(0), "second", "hb"), 1);
    assert!(errors(&a, 2).is_empty());
    let a = h.join(3, reg(W, None, "third", "hc"), 2);
    let (rank, map) = map_for(&a, 2).unwrap();
    assert_eq!(rank, 0);
    assert_eq!(map.workers[0].name, "second");
    assert_eq!(map.workers.len(), 2);
}

#[test]
fn barriers_complete_when_every_live_member_arrives() {
    let (mut h, _) = Harness::running(&cfg(2, 1));
    let a = h.send(1, barrier(2, BarrierGroup::Workers), 10);
    assert!(sent(&a, 1).is_empty());
    let a = h.send(2, barrier(2, BarrierGroup::Workers), 11);
    for conn in [1, 2] {
        assert_eq!(
            sent(&a, conn),
            [&Message::BarrierDone {
                id: 2,
                last: worker(1)
            }]
        );
    }
    assert!(
        sent(&a, 101).is_empty(),
        "servers are not in workers barriers"
    );

    h.send(1, barrier(3, BarrierGroup::All), 12);
    h.send(101, barrier(3, BarrierGroup::All), 13);
    let a = h.send(2, barrier(3, BarrierGroup::All), 14);
    for conn in [1, 2, 101] {
        assert_eq!(
            sent(&a, conn),
            [&Message::BarrierDone {
                id: 3,
                last: worker(1)
            }]
        );
    }

    let a = h.send(101, barrier(4, BarrierGroup::Workers), 15);
    let e = errors(&a, 101);
    assert_eq!((e[0].code, e[0].key), (ErrorCode::UnexpectedOp, Some(4)));
    assert!(
        e[0].message.contains("only workers are members"),
        "{}",
        e[0].message
    );

    let a = h.send(1, barrier(2, BarrierGroup::Workers), 16);
    let e = errors(&a, 1);
    assert_eq!(e[0].code, ErrorCode::UnexpectedOp);
    assert!(
        e[0].message
            .contains("workers barrier 2 after workers barrier 2: barrier ids must increase"),
        "{}",
        e[0].message
    );
    assert!(!closed(&a, 1));
}

#[test]
fn a_failed_member_fails_its_barriers_and_every_other_node_hears_why() {
    let (mut h, _) = Harness::running(&cfg(3, 1));
    h.send(1, barrier(2, BarrierGroup::Workers), 10);
    h.send(2, barrier(2, BarrierGroup::Workers), 11);
    let a = h.m.disconnected(3, "connection closed without shutdown");
    let expected = (
        worker(2),
        "w2".to_string(),
        "connection closed without shutdown".to_string(),
    );
    for conn in [1, 2, 101] {
        assert_eq!(
            failures(&a, conn),
            std::slice::from_ref(&expected),
            "conn {conn}"
        );
    }
    assert!(sent(&a, 3).is_empty(), "the failed node is not told");
    assert!(
        !a.iter()
            .any(|x| matches!(x, Action::Send(_, Message::BarrierDone { .. }))),
        "the barrier must not complete"
    );
    assert!(logs(&a).contains("workers barrier 2 can never complete because worker 2 'w2' failed"));

    // Later barriers of a group with a failed member fail at once, naming it.
    let a = h.send(1, barrier(4, BarrierGroup::Workers), 12);
    let e = errors(&a, 1);
    assert_eq!((e[0].code, e[0].key), (ErrorCode::NodeFailed, Some(4)));
    assert!(
        e[0].message.contains("worker 2 'w2' failed"),
        "{}",
        e[0].message
    );
    let a = h.send(101, barrier(3, BarrierGroup::All), 13);
    assert_eq!(errors(&a, 101)[0].code, ErrorCode::NodeFailed);
    assert!(outcome(&a).is_none(), "the job goes on while workers live");
}

#[test]
fn heartbeat_silence_fails_a_node_only_past_the_timeout() {
    let (mut h, _) = Harness::running(&cfg(2, 0));
    let a = h.send(1, Message::Heartbeat { seq: 7 }, 1000);
    assert_eq!(sent(&a, 1), [&Message::HeartbeatAck { seq: 7 }]);
    let a = h.m.tick(h.at(3000));
    assert!(a.is_empty(), "silence equal to the timeout is alive: {a:?}");
    let a = h.m.tick(h.at(3010));
    let f = failures(&a, 1);
    assert_eq!(f.len(), 1);
    assert_eq!((f[0].0, f[0].1.as_str()), (worker(1), "w1"));
    assert!(
        f[0].2
            .starts_with("no heartbeat for 3.01s (timeout 3.00s), last seen 0.00s after"),
        "{}",
        f[0].2
    );
    assert!(closed(&a, 2));
    assert_eq!(errors(&a, 2)[0].code, ErrorCode::Timeout);
    assert!(h.m.tick(h.at(3500)).is_empty(), "worker 0 heard 2.5s ago");

    let t = Instant::now();
    let d = Duration::from_millis(500);
    assert_eq!(silence_verdict(t, t + d, d, t), None);
    assert!(silence_verdict(t, t + d + Duration::from_nanos(1), d, t).is_some());
}

#[test]
fn a_node_silent_before_the_map_is_dropped_not_failed() {
    let mut h = Harness::new(&cfg(2, 0));
    h.join(1, reg(W, None, "quiet", "ha"), 0);
    let a = h.m.tick(h.at(3001));
    assert!(closed(&a, 1));
    assert!(logs(&a).contains("dropping worker 'quiet' before the cluster map"));
    assert!(outcome(&a).is_none());
}

#[test]
fn graceful_leave_is_never_reported_but_a_closed_connection_is() {
    let (mut h, _) = Harness::running(&cfg(2, 1));
    let a = h.send(
        1,
        Message::Shutdown {
            reason: "training done".into(),
        },
        10,
    );
    assert!(closed(&a, 1));
    assert!(failures(&a, 2).is_empty() && failures(&a, 101).is_empty());
    assert!(logs(&a).contains("worker 0 'w0' left: training done"));
    assert!(
        h.m.disconnected(1, "connection closed without shutdown")
            .is_empty(),
        "the close after a leave is expected"
    );

    let a = h.m.disconnected(2, "connection closed without shutdown");
    let f = failures(&a, 101);
    assert_eq!(f.len(), 1);
    assert_eq!(f[0].1, "w1");
    let reason = "no live workers remain: 1 finished, 1 failed";
    assert!(sent(&a, 101).contains(&&Message::Shutdown {
        reason: reason.into()
    }));
    assert!(closed(&a, 101));
    let out = outcome(&a).unwrap().as_ref().unwrap();
    assert_eq!(out.failed.len(), 1);
    assert_eq!(out.failed[0].0, worker(1));
    assert_eq!(out.stop_reason, reason);
}

#[test]
fn a_leave_can_complete_the_barrier_that_waited_for_the_leaver() {
    let (mut h, _) = Harness::running(&cfg(3, 0));
    h.send(1, barrier(2, BarrierGroup::Workers), 10);
    h.send(2, barrier(2, BarrierGroup::Workers), 11);
    let a = h.send(3, Message::Shutdown { reason: "".into() }, 12);
    // The leaver completed it; the last to enter was worker 1.
    let done = Message::BarrierDone {
        id: 2,
        last: worker(1),
    };
    assert_eq!(sent(&a, 1), [&done]);
    assert_eq!(sent(&a, 2), [&done]);
}

#[test]
fn join_barriers_name_the_last_worker_to_arrive() {
    // Worker 2 first, then worker 0, then worker 1: worker 1 arrived last.
    let (mut h, _) = Harness::running(&cfg(3, 1));
    h.send(3, barrier(2, BarrierGroup::Join), 10);
    h.send(1, barrier(2, BarrierGroup::Join), 11);
    let a = h.send(2, barrier(2, BarrierGroup::Join), 12);
    for conn in [1, 2, 3] {
        assert_eq!(
            sent(&a, conn),
            [&Message::BarrierDone {
                id: 2,
                last: worker(1)
            }]
        );
    }
    // Servers are no members of join barriers.
    let a = h.send(101, barrier(5, BarrierGroup::Join), 13);
    let e = errors(&a, 101);
    assert_eq!((e[0].code, e[0].key), (ErrorCode::UnexpectedOp, Some(5)));
    assert!(e[0].message.contains("join barrier 5"), "{}", e[0].message);
    // The next join barrier: worker 2 last this time.
    h.send(1, barrier(5, BarrierGroup::Join), 14);
    h.send(2, barrier(5, BarrierGroup::Join), 15);
    let a = h.send(3, barrier(5, BarrierGroup::Join), 16);
    assert_eq!(
        sent(&a, 1),
        [&Message::BarrierDone {
            id: 5,
            last: worker(2)
        }]
    );
}

#[test]
fn when_all_workers_have_left_the_servers_are_shut_down() {
    let (mut h, _) = Harness::running(&cfg(2, 2));
    let bye = || Message::Shutdown {
        reason: "done".into(),
    };
    let a = h.send(2, bye(), 10);
    assert!(outcome(&a).is_none());
    let a = h.send(1, bye(), 11);
    for conn in [101, 102] {
        assert_eq!(
            sent(&a, conn),
            [&Message::Shutdown {
                reason: "all workers finished".into()
            }]
        );
        assert!(closed(&a, conn));
    }
    let out = outcome(&a).unwrap().as_ref().unwrap();
    assert!(out.failed.is_empty());
    assert_eq!(out.stop_reason, "all workers finished");
}

#[test]
fn join_timeout_says_who_is_missing_and_who_joined() {
    let mut c = cfg(3, 2);
    c.join_timeout = Duration::from_secs(2);
    let mut h = Harness::new(&c);
    h.join(1, reg(W, None, "alpha", "ha"), 0);
    h.join(2, reg(S, None, "beta", "hb"), 0);
    assert!(h.m.tick(h.at(2000)).is_empty());
    let a = h.m.tick(h.at(2001));
    let Some(Err(err)) = outcome(&a) else {
        panic!("expected a join timeout: {a:?}")
    };
    assert!(matches!(
        err,
        CoordinatorError::JoinTimeout {
            workers_joined: 1,
            servers_joined: 1,
            ..
        }
    ));
    let msg = err.to_string();
    for part in [
        "only 1 of 3 workers and 1 of 2 servers joined within 2.0s",
        "missing 2 workers and 1 server",
        "worker 'alpha' (pid 42 on ha), server 'beta' (pid 42 on hb)",
    ] {
        assert!(msg.contains(part), "{part:?} not in {msg}");
    }
    for conn in [1, 2] {
        let e = errors(&a, conn);
        assert_eq!(e[0].code, ErrorCode::Timeout);
        assert_eq!(e[0].message, msg);
        assert!(closed(&a, conn));
    }
}

#[test]
fn undecodable_or_foreign_frames_are_answered_then_closed_and_reported() {
    let (mut h, _) = Harness::running(&cfg(3, 0));
    let a = h.m.invalid_frame(1, &WireError::UnknownOp(0x7e));
    let e = errors(&a, 1);
    assert_eq!(e[0].code, ErrorCode::UnknownOp);
    assert!(closed(&a, 1));
    let f = failures(&a, 2);
    assert_eq!(f[0].1, "w0");
    assert!(
        f[0].2
            .contains("sent an invalid frame: unknown op code 0x7e"),
        "{}",
        f[0].2
    );

    let push = Message::Push {
        key: 1,
        round: 0,
        dtype: Dtype::F32,
        codec: sumflow_wire::Codec::Raw,
        mode: sumflow_wire::PushMode::Sum,
        op: sumflow_wire::ReduceOp::Sum,
    };
    let a = h.send(2, push, 10);
    let e = errors(&a, 2);
    assert_eq!(e[0].code, ErrorCode::UnexpectedOp);
    assert!(e[0].message.contains("Push"), "{}", e[0].message);
    assert!(closed(&a, 2));
    assert_eq!(failures(&a, 3)[0].1, "w1");
}

#[test]
fn stop_tells_every_node_and_finishes() {
    let (mut h, _) = Harness::running(&cfg(1, 1));
    let a = h.m.stop();
    for conn in [1, 101] {
        assert_eq!(
            sent(&a, conn),
            [&Message::Shutdown {
                reason: "coordinator stopping".into()
            }]
        );
    }
    assert!(matches!(outcome(&a), Some(Ok(o)) if o.stop_reason == "coordinator stopping"));
    assert!(h.m.stop().is_empty());
}

#[test]
fn configuration_errors_name_the_setting() {
    let e = cfg(0, 1).validate().unwrap_err().to_string();
    assert!(e.contains("at least 1 worker"), "{e}");
    let mut c = cfg(1, 0);
    c.heartbeat_timeout = Duration::ZERO;
    assert!(c.validate().unwrap_err().to_string().contains("heartbeat"));
    let mut c = cfg(1, 0);
    c.max_body = 100;
    assert!(c.validate().unwrap_err().to_string().contains("frame size"));
    assert!(cfg(1, 0).validate().is_ok());
}

#[test]
fn tensor_ids_follow_the_first_declaration_across_the_job() {
    let (mut h, _) = Harness::running(&cfg(2, 1));
    let a = h.send(1, declare("a", Dtype::F32, 10), 10);
    assert_eq!(
        sent(&a, 1),
        [&Message::Declared {
            name: "a".into(),
            tensor_id: 0
        }]
    );
    assert!(
        sent(&a, 2).is_empty() && sent(&a, 101).is_empty(),
        "only the declarer hears"
    );
    let a = h.send(2, declare("b", Dtype::Bf16, 3), 11);
    assert_eq!(declared(&a, 2, "b"), Some(1));
    let a = h.send(2, declare("a", Dtype::F32, 10), 12);
    assert_eq!(
        declared(&a, 2, "a"),
        Some(0),
        "a later declarer gets the first id"
    );
    let a = h.send(1, declare("b", Dtype::Bf16, 3), 13);
    assert_eq!(declared(&a, 1, "b"), Some(1));
    let a = h.send(1, declare("a", Dtype::F32, 10), 14);
    assert_eq!(declared(&a, 1, "a"), Some(0), "declaring again is harmless");
    let a = h.send(1, declare("c", Dtype::I64, 1), 15);
    assert_eq!(declared(&a, 1, "c"), Some(2));
    assert!(logs(&a).contains("worker 0 'w0' declared tensor 'c' (i64 x 1): tensor 2"));
    assert_eq!(h.m.declarers("a"), Some(vec![0, 1]));
    assert_eq!(h.m.declarers("c"), Some(vec![0]));
    assert_eq!(h.m.declarers("d"), None);
}

#[test]
fn every_worker_gets_the_same_ids_whatever_order_it_declares_in() {
    let (mut h, _) = Harness::running(&cfg(3, 0));
    let names: Vec<String> = (0..20).map(|i| format!("layer{i}.weight")).collect();
    let mut orders = [names.clone(), names.clone(), names.clone()];
    orders[1].reverse();
    orders[2].rotate_left(7);
    // Interleave the workers: each declares its next name in turn.
    let mut maps: [Vec<(String, u32)>; 3] = Default::default();
    for i in 0..names.len() {
        for (w, order) in orders.iter().enumerate() {
            let conn = 1 + w as u64;
            maps[w].extend(declare_all(&mut h, conn, &order[i..=i], 10 + i as u64));
        }
    }
    for map in &mut maps {
        map.sort();
    }
    assert_eq!(maps[0], maps[1]);
    assert_eq!(maps[0], maps[2]);
    let mut ids: Vec<u32> = maps[0].iter().map(|(_, id)| *id).collect();
    ids.sort();
    assert_eq!(ids, (0..20).collect::<Vec<u32>>(), "ids are dense");
    // The first name to arrive anywhere got id 0: worker 0's first, then worker 1's first.
    assert_eq!(
        maps[0]
            .iter()
            .find(|(n, _)| n == "layer0.weight")
            .unwrap()
            .1,
        0
    );
    assert_eq!(
        maps[0]
            .iter()
            .find(|(n, _)| n == "layer19.weight")
            .unwrap()
            .1,
        1
    );
    for n in &names {
        assert_eq!(h.m.declarers(n), Some(vec![0, 1, 2]), "{n}");
    }
}

/// Asserts that `actions` tell every worker conn in `workers` the same job-fatal error
/// with `code`, and nothing to the servers; returns its message.
fn job_error(actions: &[Action], code: ErrorCode, workers: &[ConnId]) -> String {
    let first = errors(actions, workers[0]);
    assert_eq!(first.len(), 1, "{actions:?}");
    assert_eq!((first[0].code, first[0].key), (code, None));
    for conn in workers {
        assert_eq!(errors(actions, *conn), first, "conn {conn}");
        assert!(!closed(actions, *conn), "the connection stays open");
    }
    assert!(sent(actions, 101).is_empty(), "servers do not declare");
    assert!(
        outcome(actions).is_none(),
        "the job ends when the workers leave"
    );
    first[0].message.clone()
}

#[test]
fn a_dtype_mismatch_is_reported_to_every_worker_naming_both() {
    let (mut h, _) = Harness::running(&cfg(3, 1));
    h.send(1, declare("fc.weight", Dtype::F32, 1000), 10);
    let a = h.send(2, declare("fc.weight", Dtype::F16, 1000), 11);
    let msg = job_error(&a, ErrorCode::KeyMismatch, &[2, 1, 3]);
    assert_eq!(
        msg,
        "tensor 'fc.weight' declared as f16 x 1000 by worker 1 'w1', but as f32 x 1000 by \
         worker 0 'w0': every worker must declare each tensor with the same dtype and size"
    );
    assert!(logs(&a).contains("the job cannot continue"), "{}", logs(&a));
    assert_eq!(
        h.m.declarers("fc.weight"),
        Some(vec![0]),
        "a mismatch is not recorded"
    );
}

#[test]
fn a_size_mismatch_is_reported_to_every_worker_naming_every_declarer() {
    let (mut h, _) = Harness::running(&cfg(6, 1));
    for conn in [4, 1, 3, 6, 5] {
        h.send(conn, declare("fc.weight", Dtype::F32, 1000), 10);
    }
    let a = h.send(2, declare("fc.weight", Dtype::F32, 1024), 11);
    let msg = job_error(&a, ErrorCode::KeyMismatch, &[2, 1, 3, 4, 5, 6]);
    assert!(
        msg.starts_with(
            "tensor 'fc.weight' declared as f32 x 1024 by worker 1 'w1', but as f32 x 1000 by \
             worker 3 'w3', worker 0 'w0', worker 2 'w2' and 2 more workers: "
        ),
        "{msg}"
    );
}

#[test]
fn after_a_mismatch_every_declaration_gets_the_same_error() {
    let (mut h, _) = Harness::running(&cfg(3, 1));
    h.send(1, declare("a", Dtype::F32, 4), 10);
    h.send(2, declare("b", Dtype::F32, 4), 10);
    let a = h.send(3, declare("a", Dtype::I32, 4), 11);
    let msg = job_error(&a, ErrorCode::KeyMismatch, &[3, 1, 2]);
    for (conn, name) in [(1, "a"), (2, "b"), (3, "new"), (2, "a")] {
        let a = h.send(conn, declare(name, Dtype::F32, 4), 12);
        let e = errors(&a, conn);
        assert_eq!(
            (e.len(), e[0].code, &e[0].message),
            (1, ErrorCode::KeyMismatch, &msg)
        );
        assert!(sent(&a, conn).len() == 1, "no Declared after a mismatch");
        assert!(!closed(&a, conn));
        assert!(
            (1..=3)
                .filter(|c| *c != conn)
                .all(|c| sent(&a, c).is_empty()),
            "told once"
        );
    }
    assert!(h.m.declarers("new").is_none());
}

#[test]
fn only_workers_declare_and_only_once_the_map_is_out() {
    let mut h = Harness::new(&cfg(2, 1));
    h.join(1, reg(W, None, "w0", "h0"), 0);
    let a = h.send(1, declare("x", Dtype::F32, 1), 1);
    let e = errors(&a, 1);
    assert_eq!(e[0].code, ErrorCode::UnexpectedOp);
    assert!(
        e[0].message
            .contains("tensor 'x' declared before the cluster map"),
        "{}",
        e[0].message
    );
    assert!(!closed(&a, 1));

    h.m.connected(
        9,
        Peer {
            role: W,
            rank: None,
            name: "anon".into(),
        },
        h.at(2),
    );
    let a = h.send(9, declare("x", Dtype::F32, 1), 2);
    assert_eq!(errors(&a, 9)[0].code, ErrorCode::UnexpectedOp);
    assert!(
        closed(&a, 9),
        "a Declare before registering breaks the protocol"
    );

    h.join(2, reg(W, None, "w1", "h1"), 3);
    h.join(101, reg(S, None, "s0", "h0"), 3);
    let a = h.send(101, declare("x", Dtype::F32, 1), 4);
    let e = errors(&a, 101);
    assert_eq!((e[0].code, e[0].key), (ErrorCode::UnexpectedOp, None));
    assert_eq!(
        e[0].message,
        "server 0 's0' declared tensor 'x': only workers declare tensors"
    );
    assert!(!closed(&a, 101));
    assert!(
        h.m.declarers("x").is_none(),
        "a refused declaration has no effect"
    );
    let a = h.send(1, declare("x", Dtype::F32, 1), 5);
    assert_eq!(declared(&a, 1, "x"), Some(0));
}

#[test]
fn a_full_tensor_table_ends_the_job_naming_the_tensor() {
    let (mut h, _) = Harness::running(&cfg(2, 1));
    h.m.limit_tensors(2);
    let names: Vec<String> = ["step1.tmp", "step2.tmp"].map(String::from).to_vec();
    declare_all(&mut h, 1, &names, 10);
    let a = h.send(2, declare("step1.tmp", Dtype::F32, 10), 11);
    assert_eq!(
        declared(&a, 2, "step1.tmp"),
        Some(0),
        "known names still resolve"
    );
    let a = h.send(1, declare("step3.tmp", Dtype::F32, 10), 12);
    let msg = job_error(&a, ErrorCode::ResourceExhausted, &[1, 2]);
    assert!(
        msg.starts_with(
            "worker 0 'w0' declared tensor 'step3.tmp', but the job already has 2 tensors"
        ),
        "{msg}"
    );
}

fn undeclare(name: &str, tensor_id: u32) -> Message {
    Message::Undeclare {
        name: name.into(),
        tensor_id,
    }
}

#[test]
fn a_name_leaves_the_table_once_every_declarer_retired_it() {
    let (mut h, _) = Harness::running(&cfg(3, 1));
    // Workers 0 and 1 declare it (a tensor of two members, say); worker 2 never does.
    h.send(1, declare("t", Dtype::F32, 4), 10);
    h.send(2, declare("t", Dtype::F32, 4), 10);
    h.send(1, declare("u", Dtype::F32, 4), 10);
    assert_eq!(h.m.live_tensors(), 2);
    let a = h.send(1, undeclare("t", 0), 11);
    assert!(sent(&a, 1).is_empty(), "no reply");
    assert_eq!(
        h.m.declarers("t"),
        Some(vec![0, 1]),
        "worker 1 still uses it"
    );
    // A frame naming another id, or a worker that never declared it, changes nothing.
    let a = h.send(2, undeclare("t", 1), 12);
    assert!(
        logs(&a).contains("but the name is tensor 0; ignored"),
        "{}",
        logs(&a)
    );
    let a = h.send(3, undeclare("t", 0), 12);
    assert!(logs(&a).contains("never declared it"), "{}", logs(&a));
    let a = h.send(1, undeclare("t", 0), 12);
    assert!(logs(&a).contains("retired it before"), "{}", logs(&a));
    assert!(h.m.declarers("t").is_some());
    h.send(2, undeclare("t", 0), 13);
    assert_eq!(h.m.declarers("t"), None);
    assert_eq!(h.m.live_tensors(), 1);
    // The name is free; a new declaration gets a new id: ids are never reused.
    let a = h.send(3, declare("t", Dtype::I32, 8), 14);
    assert_eq!(declared(&a, 3, "t"), Some(2));
}

#[test]
fn a_fast_worker_s_new_declaration_waits_for_the_slow_one_to_retire() {
    let (mut h, _) = Harness::running(&cfg(2, 1));
    h.send(1, declare("t", Dtype::F32, 4), 10);
    h.send(2, declare("t", Dtype::F32, 4), 10);
    // Worker 0 is done with tensor 0 and declares the name again, in another layout.
    h.send(1, undeclare("t", 0), 11);
    let a = h.send(1, declare("t", Dtype::F32, 8), 12);
    assert!(
        sent(&a, 1).is_empty(),
        "not the old id, and no mismatch: worker 1 still uses tensor 0"
    );
    // Worker 1, still on tensor 0, is answered as before.
    let a = h.send(2, declare("t", Dtype::F32, 4), 13);
    assert_eq!(declared(&a, 2, "t"), Some(0));
    // Worker 1 retires it: worker 0's declaration is answered with a new id.
    let a = h.send(2, undeclare("t", 0), 14);
    assert_eq!(declared(&a, 1, "t"), Some(1));
    let a = h.send(2, declare("t", Dtype::F32, 8), 15);
    assert_eq!(declared(&a, 2, "t"), Some(1));
}

#[test]
fn the_table_limit_counts_live_tensors_only() {
    let (mut h, _) = Harness::running(&cfg(1, 1));
    h.m.limit_tensors(2);
    for i in 0..10u32 {
        let name = format!("allreduce.noname.{i}");
        let a = h.send(1, declare(&name, Dtype::F32, 4), 10);
        assert_eq!(declared(&a, 1, &name), Some(i), "ids run on");
        h.send(1, undeclare(&name, i), 11);
    }
    assert_eq!(h.m.live_tensors(), 0);
    h.send(1, declare("a", Dtype::F32, 4), 12);
    h.send(1, declare("b", Dtype::F32, 4), 12);
    let a = h.send(1, declare("c", Dtype::F32, 4), 12);
    let e = errors(&a, 1);
    assert_eq!(e[0].code, ErrorCode::ResourceExhausted);
    assert!(
        e[0].message.contains("retired tensors do not count"),
        "{}",
        e[0].message
    );
}

#[test]
fn a_failure_is_an_incident_naming_the_node_its_machine_and_pid() {
    let (mut h, _) = Harness::running(&cfg(2, 1));
    let a = h.m.disconnected(2, "connection reset");
    let i = incidents(&a);
    assert_eq!(i.len(), 1, "{a:?}");
    assert_eq!(i[0].kind, IncidentKind::Failed);
    assert_eq!((i[0].node, i[0].name.as_str()), (worker(1), "w1"));
    assert_eq!(
        (i[0].host_id.as_str(), i[0].reason.as_str()),
        ("h1", "connection reset")
    );
    assert_eq!(i[0].pid, reg(W, None, "w1", "h1").pid);
}

#[test]
fn a_servers_stall_report_names_the_stalled_workers_and_the_tensor() {
    let (mut h, _) = Harness::running(&cfg(3, 1));
    let id = declared(
        &h.send(1, declare("fc.weight", Dtype::F32, 8), 0),
        1,
        "fc.weight",
    )
    .unwrap();
    let key = u64::from(id) << 32 | 2;
    let report = Message::Stalled {
        key,
        round: 7,
        waited_ms: 61_000,
        missing: vec![1, 2],
    };
    let a = h.send(101, report.clone(), 5);
    let i = incidents(&a);
    let stalled: Vec<(NodeId, IncidentKind)> = i.iter().map(|i| (i.node, i.kind)).collect();
    assert_eq!(
        stalled,
        [
            (worker(1), IncidentKind::Stalled),
            (worker(2), IncidentKind::Stalled)
        ]
    );
    let log = logs(&a);
    assert!(
        log.contains("worker 1 'w1', worker 2 'w2': has not pushed round 7 of tensor 'fc.weight'")
            && log.contains("server 0 's0' for 61 s"),
        "{log}"
    );
    assert!(sent(&a, 101).is_empty(), "nothing answers a report");
    assert!(
        !closed(&a, 2),
        "a stalled worker is not failed: it may yet come back"
    );

    // A worker gone meanwhile is a failure already, not a stall.
    h.m.disconnected(3, "connection reset");
    let i = h.send(101, report, 6);
    assert_eq!(
        incidents(&i).iter().map(|i| i.node).collect::<Vec<_>>(),
        [worker(1)]
    );
}

#[test]
fn a_worker_reports_the_stalls_of_its_machines_shared_memory_but_not_before_the_job_starts() {
    let (mut h, _) = Harness::running(&cfg(2, 0));
    let report = Message::Stalled {
        key: 0,
        round: 3,
        waited_ms: 2_000,
        missing: vec![0, 1],
    };
    let a = h.send(1, report.clone(), 5);
    let i = incidents(&a);
    assert_eq!(
        i.iter().map(|i| i.node).collect::<Vec<_>>(),
        [worker(1)],
        "not itself"
    );
    assert!(
        i[0].reason
            .starts_with("has not pushed round 3 of key 0x0 to their machine's shared memory (worker 0 'w0' waits) for 2 s"),
        "{}",
        i[0].reason
    );

    let mut h = Harness::new(&cfg(2, 0));
    h.join(1, reg(W, None, "w0", "h0"), 0);
    let a = h.send(1, report, 5);
    assert_eq!(errors(&a, 1)[0].code, ErrorCode::UnexpectedOp);
    assert!(
        errors(&a, 1)[0].message.contains("before the job started"),
        "{a:?}"
    );
    assert!(closed(&a, 1));
}
