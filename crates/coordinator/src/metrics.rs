//! What the coordinator tells an operator's scraper (`--metrics-bind`): the job's nodes by
//! role and status, stalls reported, tensors and barriers, in Prometheus' text format.

use sumflow_wire::metrics::Exposition;

use crate::membership::Counts;

/// The exposition of one scrape of the coordinator's `counts`.
pub fn render(c: &Counts) -> String {
    let mut nodes = Vec::new();
    for (r, role) in ["worker", "server"].iter().enumerate() {
        for (s, status) in ["live", "left", "failed"].iter().enumerate() {
            nodes.push((r, s, role, status));
        }
    }
    let labels: Vec<[(&str, &str); 2]> = nodes
        .iter()
        .map(|(_, _, role, status)| [("role", **role), ("status", **status)])
        .collect();
    let samples: Vec<(&[(&str, &str)], f64)> = nodes
        .iter()
        .zip(&labels)
        .map(|((r, s, _, _), l)| (&l[..], c.nodes[*r][*s] as f64))
        .collect();
    let mut e = Exposition::default();
    e.gauge(
        "sumflow_coordinator_running",
        "1 while the job runs (the cluster map went out, the job has not ended).",
        f64::from(u8::from(c.running)),
    )
    .family(
        "sumflow_coordinator_nodes",
        "The job's ranked nodes by role and status.",
        "gauge",
        &samples,
    )
    .gauge(
        "sumflow_coordinator_joining_nodes",
        "Nodes registered while the job gathers, before ranks are given.",
        c.joining as f64,
    )
    .gauge(
        "sumflow_coordinator_connections",
        "Open connections (nodes, and any in their handshake).",
        c.connections as f64,
    )
    .counter(
        "sumflow_coordinator_stalls_reported_total",
        "Workers reported stalled (a round waited past the stall warning for their push).",
        c.stalls_reported,
    )
    .gauge(
        "sumflow_coordinator_tensors",
        "Tensor names in the table now.",
        c.tensors as f64,
    )
    .counter(
        "sumflow_coordinator_tensor_ids_total",
        "Tensor ids given out.",
        c.tensor_ids,
    )
    .counter(
        "sumflow_coordinator_tensors_retired_total",
        "Tensors retired by every worker that declared them.",
        c.tensors_retired,
    )
    .gauge(
        "sumflow_coordinator_barriers_waiting",
        "Barriers some node waits in.",
        c.barriers_waiting as f64,
    );
    e.into_text()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_are_labelled_by_role_and_status() {
        let mut c = Counts {
            running: true,
            stalls_reported: 2,
            ..Counts::default()
        };
        c.nodes[0] = [3, 0, 1];
        c.nodes[1][0] = 2;
        let text = render(&c);
        assert!(text.contains("sumflow_coordinator_running 1\n"), "{text}");
        assert!(text.contains("sumflow_coordinator_nodes{role=\"worker\",status=\"live\"} 3\n"));
        assert!(text.contains("sumflow_coordinator_nodes{role=\"worker\",status=\"failed\"} 1\n"));
        assert!(text.contains("sumflow_coordinator_nodes{role=\"server\",status=\"live\"} 2\n"));
        assert!(text.contains("sumflow_coordinator_stalls_reported_total 2\n"));
    }
}
