//! The network: full-duplex NICs into a non-blocking switch (BytePS §4.1's full bisection
//! bandwidth), carrying messages on connections.
//!
//! A machine's *uplink* (NIC to switch) serves the connections that have bytes to send in
//! turn, one segment each: per-connection fairness, as TCP shares a link. A segment reaches
//! the destination's *downlink* (switch port to NIC) after the latency and is forwarded in
//! arrival order (the port's FIFO queue) as soon as its first byte is there (cut-through),
//! finishing no earlier than its last byte arrives; with *fair downlinks* the port instead
//! serves the connections with segments waiting in turn, one segment each, as TCP's flows
//! converge to equal shares of the link they bottleneck on (in arrival order, a sender
//! with more upstream capacity would take the port). Both directions are work-conserving,
//! so a link's busy time is exactly its bytes over its rate; what sharing a link costs a
//! message shows in when its last segment gets through.
//!
//! A message stands for `factor` identical copies on each link it crosses (the GPUs of one
//! machine pushing the same partition, or identical machines folded into one; see
//! `crate::plan`): its segments take `factor` times as long there, which is when the last
//! of the copies would get through if the link interleaved them. A connection sends its
//! messages in order. When a message comes up, the sending process prepares it (the
//! per-message overhead, for each message it stands for there), one message at a time per
//! machine; that holds the connection, not the link. Messages between processes of one
//! machine (a worker and its colocated server) never touch the NIC: they take their bytes
//! over the intra-machine bandwidth, in order per connection.
//!
//! How much a connection may queue at its NIC ahead of the others is its *allowance*: one
//! segment for round robin, more for bursts. With a spread it differs between connections
//! and is drawn again each time the connection has queued that much, as TCP's windows
//! differ between flows and change from one round trip to the next: connections then
//! share a link unevenly over tens of milliseconds, and never lose bytes or time overall.

use std::collections::VecDeque;

use crate::queue::EventQueue;
use crate::random::{Stream, CONNECTION_STREAMS};
use crate::time::{from_secs, transfer, Time};

pub type ConnId = u32;
pub type MsgId = u32;

/// A part of a message on its way through the switch.
#[derive(Clone, Copy, Debug)]
pub struct Segment {
    msg: MsgId,
    bytes: u64,
    /// When its last byte leaves the sender's NIC.
    sent: Time,
    last: bool,
}

/// What the network needs the event loop to come back with.
#[derive(Debug)]
pub enum NetEvent {
    /// A segment's last byte left machine `machine`.
    Sent { machine: u32 },
    /// A segment's first byte reached the switch port of machine `machine`.
    Arrived { machine: u32, segment: Segment },
    /// Machine `machine`'s downlink finished forwarding a segment.
    Forwarded { machine: u32 },
    /// A connection's message has been prepared: it may use the link.
    Ready { conn: ConnId },
    /// A message between processes of one machine arrived.
    Local { msg: MsgId },
}

#[derive(Debug)]
pub struct Msg<P> {
    pub conn: ConnId,
    pub bytes: u64,
    /// Copies this message stands for on the sender's NIC and on the receiver's.
    pub up_factor: u32,
    pub down_factor: u32,
    /// Messages its sending process prepares for it (0: none, an acknowledgement).
    pub cpu: u32,
    pub payload: P,
    /// When it became its connection's message in progress.
    pub started: Time,
}

#[derive(Debug)]
struct Conn {
    from: u32,
    to: u32,
    /// Between processes of one machine: over the intra-machine bandwidth, not the NIC.
    local: bool,
    waiting: VecDeque<MsgId>,
    /// The message being written to the NIC and its bytes not written yet.
    writing: Option<(MsgId, u64)>,
    /// Whether that message has been prepared.
    ready: bool,
    /// Bytes of this connection in its uplink's queue.
    queued: u64,
    /// Bytes it may have there, and how many it has queued since that was drawn.
    allowance: u64,
    queued_since_draw: u64,
    draws: Stream,
    /// For a connection inside one machine: when its last message arrives.
    local_free: Time,
    /// With fair downlinks: its segments waiting at the destination's switch port.
    arrived: VecDeque<Segment>,
}

/// A segment waiting in, or leaving, a NIC's queue.
#[derive(Clone, Copy, Debug)]
struct Queued {
    conn: ConnId,
    msg: MsgId,
    bytes: u64,
    last: bool,
}

#[derive(Debug, Default)]
struct Uplink {
    rate: f64,
    busy: bool,
    queue: VecDeque<Queued>,
    serving: Option<Queued>,
    usage: Usage,
}

#[derive(Debug, Default)]
struct Downlink {
    rate: f64,
    busy: bool,
    /// Arrived segments in arrival order, or with fair downlinks the connections with
    /// segments waiting, in turn.
    queue: VecDeque<Segment>,
    turns: VecDeque<ConnId>,
    serving: Option<Segment>,
    usage: Usage,
}

/// A link's transmissions that began while the network was measuring.
#[derive(Clone, Copy, Debug, Default)]
pub struct Usage {
    pub busy: Time,
    pub bytes: u64,
}

#[derive(Debug)]
pub struct Network<P> {
    uplinks: Vec<Uplink>,
    downlinks: Vec<Downlink>,
    conns: Vec<Conn>,
    msgs: Vec<Option<Msg<P>>>,
    free: Vec<MsgId>,
    segment: u64,
    /// Bytes a connection may have in its NIC's queue, on average, and how far (a
    /// fraction of it) a connection's allowance may be from that.
    nic_queue: u64,
    nic_queue_spread: f64,
    /// Seeds the connections' draws.
    seed: u64,
    /// Switch ports serve their connections in turn rather than in arrival order.
    fair_downlinks: bool,
    /// Per machine: when its sending process has prepared every message it took on.
    cpu_free: Vec<Time>,
    overhead: Time,
    latency: Time,
    intra_rate: f64,
    /// Whether link usage is being counted (the measured iterations).
    pub measuring: bool,
}

/// The network's shape and costs.
#[derive(Clone, Copy, Debug)]
pub struct Costs {
    pub segment: u64,
    /// Bytes a connection may queue at its NIC ahead of other connections' (at most
    /// one segment: per-segment round robin).
    pub nic_queue: u64,
    /// How far a connection's allowance may be from `nic_queue`, as a fraction of it.
    pub nic_queue_spread: f64,
    /// Seeds the allowances' draws.
    pub seed: u64,
    /// Switch ports serve their connections in turn rather than in arrival order.
    pub fair_downlinks: bool,
    pub latency_s: f64,
    /// Sender CPU time per message.
    pub overhead_s: f64,
    pub intra_rate: f64,
}

impl<P> Network<P> {
    /// Machines with the given NIC rates (bytes/s, each direction).
    pub fn new(rates: &[f64], costs: Costs) -> Self {
        Network {
            uplinks: rates
                .iter()
                .map(|&rate| Uplink {
                    rate,
                    ..Uplink::default()
                })
                .collect(),
            downlinks: rates
                .iter()
                .map(|&rate| Downlink {
                    rate,
                    ..Downlink::default()
                })
                .collect(),
            conns: Vec::new(),
            msgs: Vec::new(),
            free: Vec::new(),
            segment: costs.segment,
            nic_queue: costs.nic_queue.max(costs.segment),
            nic_queue_spread: costs.nic_queue_spread,
            seed: costs.seed,
            fair_downlinks: costs.fair_downlinks,
            cpu_free: vec![0; rates.len()],
            overhead: from_secs(costs.overhead_s),
            latency: from_secs(costs.latency_s),
            intra_rate: costs.intra_rate,
            measuring: false,
        }
    }

    /// A connection from machine `from` to machine `to` (the same machine: local).
    pub fn connect(&mut self, from: u32, to: u32) -> ConnId {
        self.add(from, to, from == to)
    }

    /// A connection from machine `m` through its NIC and back in: `m` stands for a ring
    /// neighbour that behaves exactly as it does (see `crate::plan`).
    pub fn connect_through_nic(&mut self, m: u32) -> ConnId {
        self.add(m, m, false)
    }

    fn add(&mut self, from: u32, to: u32, local: bool) -> ConnId {
        let mut draws = Stream::new(self.seed, CONNECTION_STREAMS + self.conns.len() as u64);
        let allowance = allowance(
            self.nic_queue,
            self.nic_queue_spread,
            self.segment,
            &mut draws,
        );
        self.conns.push(Conn {
            from,
            to,
            local,
            waiting: VecDeque::new(),
            writing: None,
            ready: false,
            queued: 0,
            allowance,
            queued_since_draw: 0,
            draws,
            local_free: 0,
            arrived: VecDeque::new(),
        });
        (self.conns.len() - 1) as ConnId
    }

    /// Takes a delivered message out of the network.
    pub fn take(&mut self, id: MsgId) -> Msg<P> {
        let m = self.msgs[id as usize].take().expect("a live message");
        self.free.push(id);
        m
    }

    /// Queues a message on its connection; its sender prepares `cpu` messages for it.
    #[allow(clippy::too_many_arguments)]
    pub fn send<E: From<NetEvent>>(
        &mut self,
        now: Time,
        conn: ConnId,
        bytes: u64,
        (up_factor, down_factor): (u32, u32),
        cpu: u32,
        payload: P,
        q: &mut EventQueue<E>,
    ) {
        let msg = Msg {
            conn,
            bytes,
            up_factor,
            down_factor,
            cpu,
            payload,
            started: now,
        };
        let id = match self.free.pop() {
            Some(id) => {
                self.msgs[id as usize] = Some(msg);
                id
            }
            None => {
                self.msgs.push(Some(msg));
                (self.msgs.len() - 1) as MsgId
            }
        };
        let c = &self.conns[conn as usize];
        if c.local {
            let prepared = self.prepare(now, c.from, cpu);
            let c = &mut self.conns[conn as usize];
            let start = prepared.max(c.local_free);
            c.local_free = start + transfer(bytes * u64::from(up_factor), self.intra_rate);
            q.push(c.local_free, NetEvent::Local { msg: id }.into());
            return;
        }
        let c = &mut self.conns[conn as usize];
        c.waiting.push_back(id);
        if c.writing.is_none() {
            self.write(now, conn, q);
        }
    }

    /// When machine `m`'s process, free from now on, has prepared `messages` more.
    fn prepare(&mut self, now: Time, m: u32, messages: u32) -> Time {
        if messages == 0 || self.overhead == 0 {
            return now;
        }
        let free = &mut self.cpu_free[m as usize];
        *free = (*free).max(now) + self.overhead * u64::from(messages);
        *free
    }

    /// Writes the connection's bytes into its NIC's queue while its share allows: the
    /// message in progress, then the next ones (each once prepared).
    fn write<E: From<NetEvent>>(&mut self, now: Time, conn: ConnId, q: &mut EventQueue<E>) {
        let machine = self.conns[conn as usize].from;
        loop {
            let c = &mut self.conns[conn as usize];
            let Some((id, left)) = c.writing else {
                let Some(id) = c.waiting.pop_front() else {
                    break;
                };
                let m = self.msgs[id as usize].as_mut().expect("a waiting message");
                m.started = now;
                c.writing = Some((id, m.bytes));
                let cpu = m.cpu;
                let prepared = self.prepare(now, machine, cpu);
                let ready = prepared <= now;
                self.conns[conn as usize].ready = ready;
                if !ready {
                    q.push(prepared, NetEvent::Ready { conn }.into());
                }
                continue;
            };
            let bytes = left.min(self.segment);
            if !c.ready || (c.queued > 0 && c.queued + bytes > c.allowance) {
                break;
            }
            let last = bytes == left;
            c.queued += bytes;
            c.queued_since_draw += bytes;
            if self.nic_queue_spread > 0.0 && c.queued_since_draw >= c.allowance {
                c.allowance = allowance(
                    self.nic_queue,
                    self.nic_queue_spread,
                    self.segment,
                    &mut c.draws,
                );
                c.queued_since_draw = 0;
            }
            c.writing = (!last).then_some((id, left - bytes));
            self.uplinks[machine as usize].queue.push_back(Queued {
                conn,
                msg: id,
                bytes,
                last,
            });
        }
        self.serve_uplink(now, machine, q);
    }

    /// Sends the segment at the head of the NIC's queue, unless the uplink is busy.
    fn serve_uplink<E: From<NetEvent>>(&mut self, now: Time, machine: u32, q: &mut EventQueue<E>) {
        let up = &mut self.uplinks[machine as usize];
        if up.busy {
            return;
        }
        let Some(head) = up.queue.pop_front() else {
            return;
        };
        let m = self.msgs[head.msg as usize]
            .as_ref()
            .expect("the message in progress");
        let busy = transfer(head.bytes * u64::from(m.up_factor), up.rate);
        up.busy = true;
        up.serving = Some(head);
        if self.measuring {
            up.usage.busy += busy;
            up.usage.bytes += head.bytes * u64::from(m.up_factor);
        }
        let segment = Segment {
            msg: head.msg,
            bytes: head.bytes,
            sent: now + busy,
            last: head.last,
        };
        q.push(now + busy, NetEvent::Sent { machine }.into());
        q.push(
            now + self.latency,
            NetEvent::Arrived {
                machine: self.conns[head.conn as usize].to,
                segment,
            }
            .into(),
        );
    }

    fn serve_downlink<E: From<NetEvent>>(
        &mut self,
        now: Time,
        machine: u32,
        q: &mut EventQueue<E>,
    ) {
        let down = &mut self.downlinks[machine as usize];
        if down.busy {
            return;
        }
        let s = if self.fair_downlinks {
            let Some(conn) = down.turns.pop_front() else {
                return;
            };
            let arrived = &mut self.conns[conn as usize].arrived;
            let s = arrived
                .pop_front()
                .expect("a connection in turn has a segment");
            if !arrived.is_empty() {
                down.turns.push_back(conn);
            }
            s
        } else {
            let Some(s) = down.queue.pop_front() else {
                return;
            };
            s
        };
        let m = self.msgs[s.msg as usize]
            .as_ref()
            .expect("a message in flight");
        let busy = transfer(s.bytes * u64::from(m.down_factor), down.rate);
        if self.measuring {
            down.usage.busy += busy;
            down.usage.bytes += s.bytes * u64::from(m.down_factor);
        }
        down.busy = true;
        down.serving = Some(s);
        let done = (now + busy).max(s.sent + self.latency);
        q.push(done, NetEvent::Forwarded { machine }.into());
    }

    /// Handles one of the network's own events; returns the message it delivered, if any.
    pub fn handle<E: From<NetEvent>>(
        &mut self,
        now: Time,
        event: NetEvent,
        q: &mut EventQueue<E>,
    ) -> Option<MsgId> {
        match event {
            NetEvent::Sent { machine } => {
                let up = &mut self.uplinks[machine as usize];
                up.busy = false;
                let sent = up.serving.take().expect("a segment was being sent");
                self.conns[sent.conn as usize].queued -= sent.bytes;
                self.write(now, sent.conn, q);
                self.serve_uplink(now, machine, q);
                None
            }
            NetEvent::Arrived { machine, segment } => {
                let down = &mut self.downlinks[machine as usize];
                if self.fair_downlinks {
                    let m = self.msgs[segment.msg as usize].as_ref();
                    let conn = m.expect("a message in flight").conn;
                    let arrived = &mut self.conns[conn as usize].arrived;
                    if arrived.is_empty() {
                        down.turns.push_back(conn);
                    }
                    arrived.push_back(segment);
                } else {
                    down.queue.push_back(segment);
                }
                self.serve_downlink(now, machine, q);
                None
            }
            NetEvent::Forwarded { machine } => {
                let down = &mut self.downlinks[machine as usize];
                down.busy = false;
                let s = down.serving.take().expect("a segment was being forwarded");
                self.serve_downlink(now, machine, q);
                s.last.then_some(s.msg)
            }
            NetEvent::Ready { conn } => {
                self.conns[conn as usize].ready = true;
                self.write(now, conn, q);
                None
            }
            NetEvent::Local { msg } => Some(msg),
        }
    }

    /// Usage of machine `m`'s uplink and downlink while measuring.
    pub fn usage(&self, m: u32) -> (Usage, Usage) {
        (
            self.uplinks[m as usize].usage,
            self.downlinks[m as usize].usage,
        )
    }

    pub fn machines(&self) -> u32 {
        self.uplinks.len() as u32
    }

    /// The machines a connection joins, sender first.
    pub fn ends(&self, conn: ConnId) -> (u32, u32) {
        let c = &self.conns[conn as usize];
        (c.from, c.to)
    }
}

/// A connection's allowance: `nic_queue` times 1 +- up to `spread`, at least a segment.
fn allowance(nic_queue: u64, spread: f64, segment: u64, draws: &mut Stream) -> u64 {
    if spread == 0.0 {
        return nic_queue;
    }
    let share = 1.0 + spread * (2.0 * draws.uniform() - 1.0);
    ((nic_queue as f64 * share) as u64).max(segment)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: f64 = 1e9;
    const US: Time = 1_000_000;

    fn net(
        machines: usize,
        latency_s: f64,
        nic_queue: u64,
        intra_rate: f64,
    ) -> Network<&'static str> {
        with_overhead(machines, latency_s, nic_queue, intra_rate, 0.0)
    }

    fn with_overhead(
        machines: usize,
        latency_s: f64,
        nic_queue: u64,
        intra_rate: f64,
        overhead_s: f64,
    ) -> Network<&'static str> {
        Network::new(
            &vec![GB; machines],
            Costs {
                nic_queue,
                latency_s,
                overhead_s,
                intra_rate,
                ..costs()
            },
        )
    }

    /// 1000-byte segments, round robin, no latency, no per-message cost, 1 GB/s inside.
    fn costs() -> Costs {
        Costs {
            segment: 1000,
            nic_queue: 0,
            nic_queue_spread: 0.0,
            seed: 0,
            fair_downlinks: false,
            latency_s: 0.0,
            overhead_s: 0.0,
            intra_rate: GB,
        }
    }

    /// Delivers everything; returns (time, payload) in delivery order.
    fn run(
        net: &mut Network<&'static str>,
        q: &mut EventQueue<NetEvent>,
    ) -> Vec<(Time, &'static str)> {
        let mut out = Vec::new();
        while let Some((now, ev)) = q.pop() {
            if let Some(id) = net.handle(now, ev, q) {
                out.push((now, net.take(id).payload));
            }
        }
        out
    }

    #[test]
    fn one_message_takes_its_bytes_over_the_rate_plus_the_latency() {
        let mut net = net(2, 1e-6, 0, GB);
        let mut q = EventQueue::new();
        let c = net.connect(0, 1);
        net.measuring = true;
        net.send(0, c, 10_000, (1, 1), 1, "m", &mut q);
        // 10 us on the wire, 1 us latency, cut-through: 11 us.
        assert_eq!(run(&mut net, &mut q), [(11 * US, "m")]);
        assert_eq!(net.usage(0).0.busy, 10 * US);
        assert_eq!(net.usage(1).1.bytes, 10_000);
    }

    #[test]
    fn an_uplink_interleaves_connections_segment_by_segment() {
        let mut net = net(3, 0.0, 0, GB);
        let mut q = EventQueue::new();
        let a = net.connect(0, 1);
        let b = net.connect(0, 2);
        net.send(0, a, 3000, (1, 1), 0, "a", &mut q);
        net.send(0, b, 1000, (1, 1), 0, "b", &mut q);
        // a0 b0 a1 a2: b is through after 2 us, a after 4 us.
        assert_eq!(run(&mut net, &mut q), [(2 * US, "b"), (4 * US, "a")]);
    }

    #[test]
    fn a_deep_nic_queue_sends_in_bursts_in_writing_order() {
        let mut net = net(3, 0.0, 3000, GB);
        let mut q = EventQueue::new();
        let a = net.connect(0, 1);
        let b = net.connect(0, 2);
        net.send(0, a, 3000, (1, 1), 0, "a", &mut q);
        net.send(0, b, 1000, (1, 1), 0, "b", &mut q);
        // a's three segments are queued before b's: a at 3 us, b at 4 us (round robin
        // would have b through first, at 2 us).
        assert_eq!(run(&mut net, &mut q), [(3 * US, "a"), (4 * US, "b")]);
    }

    /// Two connections of machine 0 each send 200 segments with 20-segment allowances
    /// spread by `spread`; returns when each is through, and the allowances they ended
    /// with.
    fn uneven(spread: f64, seed: u64) -> (Vec<(Time, &'static str)>, u64, u64) {
        let mut net = Network::new(
            &[GB; 3],
            Costs {
                nic_queue: 20_000,
                nic_queue_spread: spread,
                seed,
                ..costs()
            },
        );
        let mut q = EventQueue::new();
        let a = net.connect(0, 1);
        let b = net.connect(0, 2);
        net.send(0, a, 200_000, (1, 1), 0, "a", &mut q);
        net.send(0, b, 200_000, (1, 1), 0, "b", &mut q);
        let got = run(&mut net, &mut q);
        let allowances = [net.conns[0].allowance, net.conns[1].allowance];
        (got, allowances[0], allowances[1])
    }

    #[test]
    fn a_spread_shares_a_link_unevenly_and_loses_nothing() {
        let (even, a, b) = uneven(0.0, 1);
        assert_eq!((a, b), (20_000, 20_000));
        // Bursts of 20 in turn: a is through 20 us before b.
        assert_eq!(even, [(380 * US, "a"), (400 * US, "b")]);
        let (spread, a, b) = uneven(0.9, 1);
        assert_ne!(a, b);
        assert!(
            [a, b].iter().all(|x| (2_000..=38_000).contains(x)),
            "{a} {b}"
        );
        // The link stays busy: the last byte leaves at 400 us all the same, but the two
        // connections no longer finish a burst apart.
        assert_eq!(spread.last().unwrap().0, 400 * US);
        assert!(spread[1].0 - spread[0].0 > 20 * US, "{spread:?}");
        // A seed repeats its draws.
        assert_eq!(uneven(0.9, 1).0, spread);
    }

    /// Machine 0 (4 GB/s) sends 8 segments and machine 1 (1 GB/s) 2 to machine 2 (1 GB/s).
    fn converging(fair: bool) -> Vec<(Time, &'static str)> {
        let mut net = Network::new(
            &[4.0 * GB, GB, GB],
            Costs {
                fair_downlinks: fair,
                ..costs()
            },
        );
        let mut q = EventQueue::new();
        let a = net.connect(0, 2);
        let b = net.connect(1, 2);
        net.send(0, a, 8000, (1, 1), 0, "fast", &mut q);
        net.send(0, b, 2000, (1, 1), 0, "slow", &mut q);
        run(&mut net, &mut q)
    }

    #[test]
    fn a_fair_downlink_serves_its_connections_in_turn() {
        // In arrival order the slow sender's second segment waits behind the four the
        // fast one got in meanwhile; in turn it goes next. The port is busy for the 10 us
        // of 10 segments either way.
        let fifo = converging(false);
        let fair = converging(true);
        assert_eq!(fifo, [(6 * US, "slow"), (10 * US, "fast")]);
        assert_eq!(fair, [(4 * US, "slow"), (10 * US, "fast")]);
    }

    #[test]
    fn incast_shares_the_downlink_and_factors_multiply_bytes() {
        let mut net = net(3, 0.0, 0, GB);
        let mut q = EventQueue::new();
        let a = net.connect(0, 2);
        let b = net.connect(1, 2);
        net.send(0, a, 2000, (1, 1), 0, "a", &mut q);
        // b stands for three machines' copies arriving at machine 2.
        net.send(0, b, 2000, (1, 3), 0, "b", &mut q);
        let got = run(&mut net, &mut q);
        // 2000 + 3 * 2000 bytes through machine 2's downlink: done at 8 us.
        assert_eq!(got.last().unwrap().0, 8 * US);
        assert_eq!(got.len(), 2);
    }

    #[test]
    fn a_message_waits_for_its_sender_and_holds_its_connection_not_the_link() {
        let mut net = with_overhead(3, 0.0, 0, GB, 5e-6);
        let mut q = EventQueue::new();
        let a = net.connect(0, 1);
        let b = net.connect(0, 2);
        net.send(0, a, 1000, (1, 1), 1, "a1", &mut q);
        net.send(0, a, 1000, (1, 1), 1, "a2", &mut q);
        net.send(0, b, 1000, (1, 1), 0, "ack", &mut q);
        let got = run(&mut net, &mut q);
        // The acknowledgement costs nothing and goes at once; a1 after 5 us of preparing;
        // a2 is prepared from when a1 is written to the NIC, and leaves at 10 us.
        assert_eq!(got, [(US, "ack"), (6 * US, "a1"), (11 * US, "a2")]);
    }

    #[test]
    fn a_machine_prepares_one_message_at_a_time_each_copy_included() {
        let mut net = with_overhead(3, 0.0, 0, GB, 5e-6);
        let mut q = EventQueue::new();
        let a = net.connect(0, 1);
        let b = net.connect(0, 2);
        net.send(0, a, 1000, (1, 1), 2, "a", &mut q);
        net.send(0, b, 1000, (1, 1), 1, "b", &mut q);
        assert_eq!(run(&mut net, &mut q), [(11 * US, "a"), (16 * US, "b")]);
    }

    #[test]
    fn local_messages_skip_the_nic_in_order() {
        let mut net = net(1, 1e-3, 0, 2.0 * GB);
        let mut q = EventQueue::new();
        let c = net.connect(0, 0);
        net.send(0, c, 2000, (1, 1), 0, "x", &mut q);
        net.send(0, c, 2000, (2, 1), 0, "y", &mut q);
        assert_eq!(run(&mut net, &mut q), [(US, "x"), (3 * US, "y")]);
        assert_eq!(net.usage(0).0.bytes, 0);
    }

    #[test]
    fn empty_messages_keep_their_place() {
        let mut net = net(2, 0.0, 0, GB);
        let mut q = EventQueue::new();
        let c = net.connect(0, 1);
        net.send(0, c, 1000, (1, 1), 0, "data", &mut q);
        net.send(0, c, 0, (1, 1), 0, "ack", &mut q);
        assert_eq!(run(&mut net, &mut q), [(US, "data"), (US, "ack")]);
    }
}
