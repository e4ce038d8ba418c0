//! A summation server started by hand for an elastic job (`sumflow-server --elastic
//! HOST:PORT`): it asks `sumflow-run`'s rendezvous for its place in each membership epoch
//! (the epoch's coordinator), serves the epoch, and asks again, until it retires or the
//! job ends. The protocol is `python/sumflow/jobenv/elastic.py`'s: one JSON line each
//! way per connection, each request signed with the job token (HMAC-SHA256 over its
//! fields, a fresh nonce and the time), so the token never crosses the network.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use serde_json::{json, Value};
use sha2::Sha256;
use sumflow_wire::auth::random_bytes;
use sumflow_wire::JobToken;
use thiserror::Error;

/// The longest reply accepted, in bytes (the rendezvous' own limit on a line).
const MAX_LINE: u64 = 1 << 16;
/// How long one request may take on the network.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Error)]
pub enum ElasticError {
    #[error("cannot reach sumflow-run's elastic rendezvous at {addr}: {why}")]
    Unreachable { addr: String, why: String },
    #[error("the elastic rendezvous at {addr} refused {op:?}: {why}")]
    Refused {
        addr: String,
        op: &'static str,
        why: String,
    },
    #[error("malformed reply from the elastic rendezvous at {addr}: {why}")]
    Malformed { addr: String, why: String },
    #[error("the job token is not text, which the elastic rendezvous needs")]
    TokenNotText,
}

/// What the rendezvous says to a server asking for its place.
#[derive(Debug, PartialEq)]
pub enum Answer {
    /// Serve this epoch: join its coordinator as this machine.
    Serve {
        epoch: i64,
        coordinator: String,
        host_id: String,
    },
    /// Ask again shortly; the launcher may take up to `patience` seconds to form it.
    Wait { patience: Option<f64> },
    /// Leave the job, for this reason.
    Leave(String),
}

/// This server's side of the rendezvous.
pub struct Rendezvous {
    addr: String,
    token: String,
    name: String,
}

impl std::fmt::Debug for Rendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rendezvous")
            .field("addr", &self.addr)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Rendezvous {
    pub fn new(addr: &str, token: &JobToken, name: &str) -> Result<Rendezvous, ElasticError> {
        Ok(Rendezvous {
            addr: addr.to_string(),
            token: token
                .as_str()
                .ok_or(ElasticError::TokenNotText)?
                .to_string(),
            name: name.to_string(),
        })
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Its place in the first epoch after `after`, or why it should wait or leave.
    pub fn serve(&self, after: i64) -> Result<Answer, ElasticError> {
        let reply = self.request("serve", Some(after))?;
        answer(&reply).map_err(|why| ElasticError::Malformed {
            addr: self.addr.clone(),
            why,
        })
    }

    /// Tells the launcher it leaves at the job's next change of membership.
    pub fn retire(&self) -> Result<(), ElasticError> {
        self.request("retire", None).map(|_| ())
    }

    fn request(&self, op: &'static str, after: Option<i64>) -> Result<Value, ElasticError> {
        let unreachable = |why: String| ElasticError::Unreachable {
            addr: self.addr.clone(),
            why,
        };
        let nonce = hex::encode(random_bytes::<16>().map_err(|e| unreachable(e.to_string()))?);
        let time = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let mut message = json!({"op": op, "worker": self.name, "nonce": nonce, "time": time});
        if let Some(after) = after {
            message["after"] = json!(after);
        }
        message["mac"] = json!(sign(&self.token, &message));
        let target = self
            .addr
            .to_socket_addrs()
            .map_err(|e| unreachable(e.to_string()))?
            .next()
            .ok_or_else(|| unreachable("the address resolves to nothing".into()))?;
        let mut stream = TcpStream::connect_timeout(&target, REQUEST_TIMEOUT)
            .map_err(|e| unreachable(e.to_string()))?;
        stream
            .set_read_timeout(Some(REQUEST_TIMEOUT))
            .and_then(|_| stream.set_write_timeout(Some(REQUEST_TIMEOUT)))
            .map_err(|e| unreachable(e.to_string()))?;
        let mut line = message.to_string();
        line.push('\n');
        stream
            .write_all(line.as_bytes())
            .map_err(|e| unreachable(e.to_string()))?;
        let mut reply = String::new();
        BufReader::new(stream.take(MAX_LINE))
            .read_line(&mut reply)
            .map_err(|e| unreachable(e.to_string()))?;
        let malformed = |why: String| ElasticError::Malformed {
            addr: self.addr.clone(),
            why,
        };
        if !reply.ends_with('\n') {
            return Err(malformed("no whole line".into()));
        }
        let value: Value = serde_json::from_str(&reply).map_err(|e| malformed(e.to_string()))?;
        if let Some(why) = value.get("error") {
            return Err(ElasticError::Refused {
                addr: self.addr.clone(),
                op,
                why: why.as_str().unwrap_or("?").to_string(),
            });
        }
        Ok(value)
    }
}

/// The MAC of a request: HMAC-SHA256 under the token over its fields in a fixed order,
/// one per line, a missing one empty (`_signed_text` on the Python side).
fn sign(token: &str, message: &Value) -> String {
    let field = |name: &str| match message.get(name) {
        None => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
    };
    let text = ["op", "worker", "after", "epoch", "nonce", "time"]
        .iter()
        .map(|f| field(f))
        .collect::<Vec<_>>()
        .join("\n");
    let mut mac = Hmac::<Sha256>::new_from_slice(token.as_bytes()).expect("any key length");
    mac.update(text.as_bytes());
    hex::encode(mac.finalize().into_bytes())
}

fn answer(reply: &Value) -> Result<Answer, String> {
    if let Some(why) = reply.get("leave") {
        return Ok(Answer::Leave(why.as_str().unwrap_or("?").to_string()));
    }
    if reply.get("wait").and_then(Value::as_bool) == Some(true) {
        let patience = reply.get("patience").and_then(Value::as_f64);
        return Ok(Answer::Wait { patience });
    }
    let text = |key: &str| {
        reply
            .get(key)
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| format!("no {key:?} in {reply}"))
    };
    Ok(Answer::Serve {
        epoch: reply
            .get("epoch")
            .and_then(Value::as_i64)
            .ok_or_else(|| format!("no \"epoch\" in {reply}"))?,
        coordinator: text("coordinator")?,
        host_id: text("host_id")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mac_covers_the_fields_in_their_order_as_python_signs_them() {
        // The same message signed by python/sumflow/jobenv/elastic.py's `sign`:
        // hmac.new(b"t"*32, b"serve\ncpu-a\n-1\n\nabc\n1700000000", sha256).hexdigest()
        let message = json!({"op": "serve", "worker": "cpu-a", "after": -1,
                             "nonce": "abc", "time": 1_700_000_000u64});
        assert_eq!(
            sign(&"t".repeat(32), &message),
            "175d239e63b30c6884d79156171d9f5ae953145d3b020c84926e9f0b5599fda4"
        );
    }

    #[test]
    fn replies_are_read_into_answers() {
        assert_eq!(
            answer(&json!({"epoch": 2, "coordinator": "h:1", "host_id": "cpu-a"})),
            Ok(Answer::Serve {
                epoch: 2,
                coordinator: "h:1".into(),
                host_id: "cpu-a".into()
            })
        );
        assert_eq!(
            answer(&json!({"wait": true, "patience": 60.0})),
            Ok(Answer::Wait {
                patience: Some(60.0)
            })
        );
        assert_eq!(
            answer(&json!({"leave": "it retired"})),
            Ok(Answer::Leave("it retired".into()))
        );
        assert!(answer(&json!({"epoch": 2}))
            .unwrap_err()
            .contains("coordinator"));
    }
}
