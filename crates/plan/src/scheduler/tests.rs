use super::*;

const MS: Duration = Duration::from_millis(1);

fn part(key: u64, server: u32, bytes: u64) -> Ready<u64> {
    Ready {
        partition: Partition {
            key,
            bytes,
            server,
            ..Partition::default()
        },
        wire_bytes: bytes,
        item: key,
    }
}

fn keys(started: &[Started<u64>]) -> Vec<u64> {
    started.iter().map(|s| s.item).collect()
}

/// Partitions of 100 bytes, no push window unless `window` says otherwise.
fn scheduler(kind: SchedulerKind, credit: u64, servers: usize) -> Scheduler<u64> {
    windowed(kind, credit, 0, servers)
}

fn windowed(kind: SchedulerKind, credit: u64, window: u64, servers: usize) -> Scheduler<u64> {
    let mut s = Schedule::new(kind, 100);
    s.credit_bytes = credit;
    s.window_bytes = window;
    Scheduler::new(s, 100, servers, Instant::now())
}

#[test]
fn names_parse_and_unknown_ones_are_refused() {
    for k in SchedulerKind::ALL {
        assert_eq!(k.name().parse::<SchedulerKind>(), Ok(k));
    }
    assert_eq!(" ByteScheduler ".parse(), Ok(SchedulerKind::ByteScheduler));
    let e = "lifo".parse::<SchedulerKind>().unwrap_err();
    assert!(e.contains("fifo, p3, bytescheduler, prophet"), "{e}");
}

#[test]
fn fifo_sends_in_arrival_order_whatever_the_priority() {
    let t = Instant::now();
    // No credit: everything goes at once, in arrival order.
    let mut s = scheduler(SchedulerKind::Fifo, 100, 1);
    s.ready(0, 9, vec![part(1, 0, 100)], t);
    s.ready(1, 0, vec![part(2, 0, 100)], t);
    s.ready(2, 5, vec![part(3, 0, 100)], t);
    assert_eq!(keys(&s.poll(t)), [1, 2, 3]);
    // A one-partition push window paces them, still in arrival order.
    let mut s = windowed(SchedulerKind::Fifo, 0, 100, 1);
    s.ready(0, 9, vec![part(1, 0, 100)], t);
    s.ready(1, 0, vec![part(2, 0, 100)], t);
    s.ready(2, 5, vec![part(3, 0, 100)], t);
    let first = s.poll(t);
    assert_eq!(keys(&first), [1]);
    s.finished(first[0].order, t);
    let second = s.poll(t);
    assert_eq!(
        keys(&second),
        [2],
        "arrival order, although 3 has a lower priority value"
    );
    s.finished(second[0].order, t);
    assert_eq!(keys(&s.poll(t)), [3]);
}

/// ByteScheduler §4.2: tensor 1 is being sent when 2, 3 and 4 arrive one by one, each
/// more urgent than the one before (the paper's priorities p1 < p2 < p3 < p4 rank higher
/// values first; ours rank lower ones first). Stop-and-wait (P3) sends 1, 4, 3, 2; a
/// credit of two partitions sends 1, 2, 4, 3: 2 went out at once and cannot be preempted.
#[test]
fn credit_based_preemption_example() {
    for (kind, credit, expected) in [
        (SchedulerKind::P3, 0, [1, 4, 3, 2]),
        (SchedulerKind::ByteScheduler, 200, [1, 2, 4, 3]),
    ] {
        let t = Instant::now();
        let mut s = scheduler(kind, credit, 1);
        let mut sent = Vec::new();
        for tensor in 1..=4u32 {
            let prio = 10 - i64::from(tensor);
            s.ready(tensor, prio, vec![part(u64::from(tensor), 0, 100)], t);
            sent.extend(s.poll(t));
        }
        let mut done = 0;
        while done < sent.len() {
            s.finished(sent[done].order, t);
            done += 1;
            sent.extend(s.poll(t));
        }
        assert_eq!(keys(&sent), expected, "{kind}");
    }
}

#[test]
fn credit_is_per_server() {
    let t = Instant::now();
    let mut s = scheduler(SchedulerKind::ByteScheduler, 200, 2);
    s.ready(
        0,
        0,
        (0..6).map(|k| part(k, (k % 2) as u32, 100)).collect(),
        t,
    );
    let out = s.poll(t);
    assert_eq!(keys(&out), [0, 2, 1, 3]);
    assert_eq!(s.waiting(), 2);
    s.finished(out[2].order, t + MS);
    assert_eq!(keys(&s.poll(t + MS)), [5]);
}

#[test]
fn set_credit_takes_effect_on_the_next_poll() {
    let t = Instant::now();
    let mut s = scheduler(SchedulerKind::ByteScheduler, 100, 1);
    s.ready(0, 0, (0..4).map(|k| part(k, 0, 100)).collect(), t);
    assert_eq!(s.poll(t).len(), 1);
    s.set_credit(300, 100);
    assert_eq!(keys(&s.poll(t)), [1, 2]);
    assert_eq!(s.schedule().credit_bytes, 300);
}

#[test]
fn a_stalled_push_window_has_a_deadline_and_lets_one_more_out() {
    let t = Instant::now();
    let mut s = windowed(SchedulerKind::ByteScheduler, 0, 100, 1);
    s.ready(0, 5, vec![part(1, 0, 100), part(2, 0, 100)], t);
    assert_eq!(s.poll(t).len(), 1);
    assert_eq!(s.next_deadline(t), Some(t + WINDOW_STALL));
    assert!(s.poll(t + WINDOW_STALL / 2).is_empty());
    assert_eq!(keys(&s.poll(t + WINDOW_STALL)), [2]);
}

#[test]
fn credit_returns_on_acknowledgement_before_the_sum() {
    let t = Instant::now();
    let mut s = windowed(SchedulerKind::ByteScheduler, 100, 400, 1);
    s.ready(0, 0, (0..3).map(|k| part(k, 0, 100)).collect(), t);
    let first = s.poll(t);
    assert_eq!(keys(&first), [0]);
    s.acknowledged(first[0].order, t);
    assert_eq!(
        keys(&s.poll(t)),
        [1],
        "the credit came back, the window has room"
    );
    assert_eq!(s.in_flight(), 2);
}

/// Prophet keeps to ByteScheduler's credit, and a gap long enough for more sends a block
/// past it; the last gradients go under the credit alone.
#[test]
fn prophet_sends_a_block_past_the_credit_in_a_gap() {
    let mut s = scheduler(SchedulerKind::Prophet, 1000, 1);
    let mut t = Instant::now();
    // Iterations of a 4-tensor model: tensor 3 (priority 3) first, a 50 ms gap, then 2, 1
    // and 0 close together. Each partition completes 10 ms after it starts.
    let iteration = |s: &mut Scheduler<u64>, t: Instant| -> Vec<Vec<u64>> {
        let mut sent = Vec::new();
        for (tensor, at) in [(3u32, 0u32), (2, 50), (1, 51), (0, 52)] {
            let now = t + at * MS;
            s.ready(
                tensor,
                i64::from(tensor),
                vec![
                    part(u64::from(tensor) * 10, 0, 1000),
                    part(u64::from(tensor) * 10 + 1, 0, 1000),
                ],
                now,
            );
            let out = s.poll(now);
            sent.push(keys(&out));
            for x in out {
                s.finished(x.order, now + 10 * MS);
            }
        }
        s.mark_step();
        // The forward pass waits for every sum: the rest drains before the next backward.
        let end = t + 100 * MS;
        loop {
            let out = s.poll(end);
            if out.is_empty() {
                break;
            }
            for x in out {
                s.finished(x.order, end);
            }
        }
        sent
    };
    for _ in 0..3 {
        let sent = iteration(&mut s, t);
        // Unprofiled: the credit alone, most urgent first.
        assert_eq!(sent, [vec![30], vec![20], vec![10], vec![0]]);
        t += 200 * MS;
        if s.profile().is_some() && s.bandwidth().is_some() {
            break;
        }
    }
    // Measured from the transfers: 2000 bytes fit the 50 ms gap after tensor 3.
    let rate = s.bandwidth().unwrap();
    assert!(rate > 2000.0 / 0.05, "{rate}");
    let sent = iteration(&mut s, t);
    assert_eq!(
        sent[0],
        [30, 31],
        "a block of both, past the one-partition credit"
    );
    // After tensors 2 and 1 the gaps are 1 ms, too short for a block: the credit alone.
    assert_eq!(sent[1], [20]);
    assert_eq!(sent[2], [10]);
    assert_eq!(sent[3], [0], "the last gradient: the credit alone");
}

#[test]
fn drain_removes_the_waiting_partitions_of_a_server() {
    let t = Instant::now();
    let mut s = scheduler(SchedulerKind::ByteScheduler, 100, 2);
    s.ready(
        0,
        0,
        (0..4).map(|k| part(k, (k % 2) as u32, 100)).collect(),
        t,
    );
    let started = s.poll(t);
    assert_eq!(keys(&started), [0, 1]);
    let mut gone = s.drain_where(|server, _| server == 1);
    gone.sort();
    assert_eq!(gone, [3]);
    assert_eq!(s.waiting(), 1);
    s.abandoned(started[1].order, t);
    assert_eq!(s.in_flight(), 1);
    assert!(s.poll(t).is_empty(), "server 0 is still full");
}

#[test]
fn machines_of_several_workers_get_a_narrower_default_window() {
    assert_eq!(default_window_partitions(0), DEFAULT_WINDOW_PARTITIONS);
    assert_eq!(default_window_partitions(1), DEFAULT_WINDOW_PARTITIONS);
    for g in [2, 4, 8] {
        assert_eq!(
            default_window_partitions(g),
            DEFAULT_WINDOW_PARTITIONS_SEVERAL_WORKERS
        );
    }
}
