//! Metrics an operator scrapes: a minimal HTTP endpoint serving Prometheus' text format
//! (`GET /metrics`) for the summation servers and the coordinator (`--metrics-bind`).
//!
//! It is off unless asked for, answers nothing but counts (no tensor names, no token), and
//! is built to be harmless on an open port: one thread, one request per connection, a
//! 4 KiB request limit and a 2 s deadline per connection, so a slow or hostile client
//! costs a few seconds of one thread at most and never the job.

use std::fmt::Write as _;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Longest request head read; a scraper's is a few hundred bytes.
const MAX_REQUEST: usize = 4 << 10;
/// Time a client has to send its request and read the answer.
const DEADLINE: Duration = Duration::from_secs(2);
/// How often the accept loop looks at the stop flag.
const ACCEPT_POLL: Duration = Duration::from_millis(50);

/// The text of one scrape, metric by metric, in Prometheus' exposition format.
#[derive(Debug, Default)]
pub struct Exposition {
    text: String,
}

impl Exposition {
    /// A counter (only ever grows) without labels.
    pub fn counter(&mut self, name: &str, help: &str, value: u64) -> &mut Self {
        self.family(name, help, "counter", &[(&[], value as f64)])
    }

    /// A gauge (goes up and down) without labels.
    pub fn gauge(&mut self, name: &str, help: &str, value: f64) -> &mut Self {
        self.family(name, help, "gauge", &[(&[], value)])
    }

    /// One metric with a sample per label set, e.g. nodes by role and status.
    pub fn family(
        &mut self,
        name: &str,
        help: &str,
        kind: &str,
        samples: &[(&[(&str, &str)], f64)],
    ) -> &mut Self {
        let t = &mut self.text;
        let _ = writeln!(
            t,
            "# HELP {name} {}",
            help.replace('\\', "\\\\").replace('\n', "\\n")
        );
        let _ = writeln!(t, "# TYPE {name} {kind}");
        for (labels, value) in samples {
            t.push_str(name);
            if !labels.is_empty() {
                t.push('{');
                for (i, (k, v)) in labels.iter().enumerate() {
                    if i > 0 {
                        t.push(',');
                    }
                    let v = v
                        .replace('\\', "\\\\")
                        .replace('"', "\\\"")
                        .replace('\n', "\\n");
                    let _ = write!(t, "{k}=\"{v}\"");
                }
                t.push('}');
            }
            let _ = writeln!(t, " {value}");
        }
        self
    }

    /// The finished text.
    pub fn into_text(self) -> String {
        self.text
    }
}

/// What renders a scrape: called on the exporter's thread for each `GET /metrics`.
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// A running endpoint; dropping it stops it.
pub struct MetricsEndpoint {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for MetricsEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsEndpoint")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl MetricsEndpoint {
    /// Listens on `bind` and serves `render`'s text at `/metrics` from a thread of its own.
    pub fn start(bind: SocketAddr, render: Render) -> io::Result<MetricsEndpoint> {
        let listener = TcpListener::bind(bind)?;
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("sumflow-metrics".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((stream, _)) => {
                            let _ = answer(stream, &*render);
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            std::thread::sleep(ACCEPT_POLL);
                        }
                        // Out of descriptors, say: wait and go on; scrapes are not urgent.
                        Err(_) => std::thread::sleep(ACCEPT_POLL),
                    }
                }
            })?;
        Ok(MetricsEndpoint {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// The address it listens on (the actual port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsEndpoint {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Reads one request head within the deadline and answers it.
fn answer(mut stream: TcpStream, render: &(dyn Fn() -> String + Send + Sync)) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    let deadline = Instant::now() + DEADLINE;
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 512];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || head.len() >= MAX_REQUEST {
            return respond(
                &mut stream,
                "408 Request Timeout",
                "request too slow or too long\n",
            );
        }
        stream.set_read_timeout(Some(left))?;
        let n = stream.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    stream.set_write_timeout(Some(
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1)),
    ))?;
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split_whitespace();
    match (parts.next(), parts.next()) {
        (Some("GET"), Some("/metrics")) => respond(&mut stream, "200 OK", &render()),
        (Some("GET"), _) => respond(&mut stream, "404 Not Found", "metrics are at /metrics\n"),
        _ => respond(&mut stream, "405 Method Not Allowed", "only GET /metrics\n"),
    }
}

fn respond(stream: &mut TcpStream, status: &str, body: &str) -> io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body.as_bytes())?;
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(addr: SocketAddr, request: &str) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    fn endpoint() -> MetricsEndpoint {
        let render: Render = Arc::new(|| {
            let mut e = Exposition::default();
            e.counter("sumflow_test_bytes_total", "Bytes.", 42).family(
                "sumflow_test_nodes",
                "Nodes by status.",
                "gauge",
                &[
                    (&[("status", "live \"ok\"")], 3.0),
                    (&[("status", "failed")], 0.0),
                ],
            );
            e.into_text()
        });
        MetricsEndpoint::start("127.0.0.1:0".parse().unwrap(), render).unwrap()
    }

    #[test]
    fn a_scrape_gets_the_exposition_with_escaped_labels() {
        let m = endpoint();
        let out = get(m.local_addr(), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(out.starts_with("HTTP/1.1 200 OK\r\n"), "{out}");
        assert!(
            out.contains("# TYPE sumflow_test_bytes_total counter\nsumflow_test_bytes_total 42\n"),
            "{out}"
        );
        assert!(
            out.contains("sumflow_test_nodes{status=\"live \\\"ok\\\"\"} 3\n"),
            "{out}"
        );
    }

    #[test]
    fn other_paths_and_methods_are_refused_and_a_silent_client_is_dropped() {
        let m = endpoint();
        assert!(get(m.local_addr(), "GET / HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
        assert!(get(m.local_addr(), "POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
        // One that never finishes its request holds the thread for the deadline only.
        let started = Instant::now();
        let mut silent = TcpStream::connect(m.local_addr()).unwrap();
        silent.write_all(b"GET /metr").unwrap();
        let out = get(m.local_addr(), "GET /metrics HTTP/1.1\r\n\r\n");
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        assert!(started.elapsed() < DEADLINE * 3, "{:?}", started.elapsed());
        let mut rest = String::new();
        let _ = silent.read_to_string(&mut rest);
        assert!(
            rest.is_empty() || rest.starts_with("HTTP/1.1 408"),
            "{rest}"
        );
    }
}
