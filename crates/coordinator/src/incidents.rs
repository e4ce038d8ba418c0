//! The incidents file (`--incidents-file`): one JSON object per line for every node the
//! coordinator declared failed or saw stalled, in the order it saw them.
//!
//! It is for whoever supervises the job. When one process of a job fails, the others
//! notice and exit too, often before the one that caused it (a hung process never
//! exits): `sumflow-run` reads this file to blame the first incident, not the process
//! whose exit it happened to see first.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::warn;

use crate::membership::Incident;
use crate::CoordinatorError;

/// An open incidents file. Writing never fails the job: a full disk is logged once.
#[derive(Debug)]
pub struct IncidentLog {
    path: PathBuf,
    file: File,
    broken: bool,
}

impl IncidentLog {
    /// Opens `path` for appending, creating it (mode 0600 on Unix: reasons may name hosts).
    pub fn open(path: &Path) -> Result<IncidentLog, CoordinatorError> {
        let mut options = OpenOptions::new();
        options.create(true).append(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let file = options
            .open(path)
            .map_err(|source| CoordinatorError::IncidentsFile {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(IncidentLog {
            path: path.to_path_buf(),
            file,
            broken: false,
        })
    }

    /// Appends one line for `incident`, stamped with the wall clock.
    pub fn record(&mut self, incident: &Incident) {
        let mut line = line(incident, SystemTime::now()).to_string();
        line.push('\n');
        // One write per line, appended: a reader never sees half of one.
        if let Err(e) = self.file.write_all(line.as_bytes()) {
            if !self.broken {
                warn!(
                    "cannot write to the incidents file {}: {e}",
                    self.path.display()
                );
                self.broken = true;
            }
        }
    }
}

/// The JSON object of one incident: `time` (seconds since the Unix epoch), `kind`
/// (`failed` or `stalled`), `role`, `rank`, `name`, `host_id`, `pid`, `reason`.
pub fn line(incident: &Incident, at: SystemTime) -> serde_json::Value {
    let time = at
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or_default();
    serde_json::json!({
        "time": time,
        "kind": incident.kind.name(),
        "role": incident.node.role.name(),
        "rank": incident.node.rank,
        "name": incident.name,
        "host_id": incident.host_id,
        "pid": incident.pid,
        "reason": incident.reason,
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use sumflow_wire::{NodeId, Role};

    use super::*;
    use crate::membership::IncidentKind;

    fn incident(reason: &str) -> Incident {
        Incident {
            kind: IncidentKind::Stalled,
            node: NodeId {
                role: Role::Worker,
                rank: 3,
            },
            name: "worker \"3\"".into(),
            host_id: "node-b".into(),
            pid: 4242,
            reason: reason.into(),
        }
    }

    #[test]
    fn a_line_names_the_node_and_escapes_what_it_quotes() {
        let at = UNIX_EPOCH + Duration::from_millis(1_500);
        let v = line(&incident("has not pushed\nround 2"), at);
        assert_eq!(v["time"], 1.5);
        assert_eq!(v["kind"], "stalled");
        assert_eq!(v["role"], "worker");
        assert_eq!(v["rank"], 3);
        assert_eq!(v["name"], "worker \"3\"");
        assert_eq!(v["pid"], 4242);
        assert!(!v.to_string().contains('\n'), "one line per incident");
    }

    #[test]
    fn incidents_are_appended_one_line_each() {
        let dir = std::env::temp_dir().join(format!("sumflow-incidents-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("incidents");
        let _ = std::fs::remove_file(&path);
        let mut log = IncidentLog::open(&path).unwrap();
        log.record(&incident("first"));
        log.record(&incident("second"));
        let text = std::fs::read_to_string(&path).unwrap();
        let reasons: Vec<String> = text
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["reason"].to_string())
            .collect();
        assert_eq!(reasons, ["\"first\"", "\"second\""]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_unwritable_path_is_an_error_naming_it() {
        let err = IncidentLog::open(Path::new("/nonexistent-dir/incidents")).unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent-dir/incidents"),
            "{err}"
        );
    }
}
