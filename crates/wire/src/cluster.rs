//! Who is in a job: roles, node descriptions and the cluster map the coordinator hands out.

use std::fmt;

/// The part a process plays in a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Role {
    /// A training process; embeds the communication service.
    Worker = 1,
    /// A summation service process (on a CPU machine or colocated with workers).
    Server = 2,
}

impl Role {
    pub fn from_code(code: u8) -> Option<Role> {
        match code {
            1 => Some(Role::Worker),
            2 => Some(Role::Server),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Role::Worker => "worker",
            Role::Server => "server",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A node's identity within a job: its role and its rank among nodes of that role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId {
    pub role: Role,
    pub rank: u32,
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.role, self.rank)
    }
}

/// One node as the cluster map describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeInfo {
    pub rank: u32,
    /// Address others connect to (servers); informational for workers.
    pub host: String,
    pub port: u16,
    /// Machine identity: nodes with equal `host_id` share a machine (colocation).
    pub host_id: String,
    pub pid: u32,
    /// The speed of the node's network link in Mbit/s, as its kernel reports it for the
    /// interface it reaches the coordinator by (or as the job set it); 0 when unknown.
    pub link_mbit: u32,
    /// Human-readable name used in logs and error messages.
    pub name: String,
}

/// `host:port` as peers dial it, an IPv6 host in brackets.
pub fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

impl NodeInfo {
    pub fn addr(&self) -> String {
        host_port(&self.host, self.port)
    }
}

/// Every node of a job with its rank, as assigned by the coordinator. Identical on every node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterMap {
    pub job_id: String,
    /// Workers ordered by rank (`workers[r].rank == r`).
    pub workers: Vec<NodeInfo>,
    /// Servers ordered by rank (`servers[r].rank == r`).
    pub servers: Vec<NodeInfo>,
}

impl ClusterMap {
    /// Ranks of the servers that share a machine with `worker` (colocated summation servers).
    pub fn colocated_servers(&self, worker: u32) -> Vec<u32> {
        let Some(w) = self.workers.get(worker as usize) else {
            return Vec::new();
        };
        self.servers
            .iter()
            .filter(|s| s.host_id == w.host_id)
            .map(|s| s.rank)
            .collect()
    }

    /// Ranks of the servers on machines that run no worker (BytePS's CPU machines).
    pub fn cpu_only_servers(&self) -> Vec<u32> {
        self.servers
            .iter()
            .filter(|s| !self.workers.iter().any(|w| w.host_id == s.host_id))
            .map(|s| s.rank)
            .collect()
    }

    /// The description of a node, if it is in the map.
    pub fn node(&self, id: NodeId) -> Option<&NodeInfo> {
        match id.role {
            Role::Worker => self.workers.get(id.rank as usize),
            Role::Server => self.servers.get(id.rank as usize),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(rank: u32, host_id: &str) -> NodeInfo {
        NodeInfo {
            rank,
            host: "127.0.0.1".into(),
            port: 9000 + rank as u16,
            host_id: host_id.into(),
            pid: 1,
            link_mbit: 0,
            name: format!("n{rank}"),
        }
    }

    #[test]
    fn colocation_follows_host_ids() {
        let map = ClusterMap {
            job_id: "j".into(),
            workers: vec![node(0, "a"), node(1, "b")],
            servers: vec![node(0, "a"), node(1, "b"), node(2, "cpu")],
        };
        assert_eq!(map.colocated_servers(0), vec![0]);
        assert_eq!(map.colocated_servers(1), vec![1]);
        assert_eq!(map.colocated_servers(7), Vec::<u32>::new());
        assert_eq!(map.cpu_only_servers(), vec![2]);
        assert_eq!(
            map.node(NodeId {
                role: Role::Server,
                rank: 2
            })
            .unwrap()
            .host_id,
            "cpu"
        );
    }

    #[test]
    fn ipv6_addresses_are_bracketed() {
        let mut n = node(0, "a");
        n.host = "::1".into();
        assert_eq!(n.addr(), "[::1]:9000");
    }
}
