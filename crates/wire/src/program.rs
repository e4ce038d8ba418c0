//! What sumflow's command-line programs (`sumflow-server`, `sumflow-coordinator`) share,
//! whether they run as binaries or in-process from the Python package's console scripts:
//! argument parsing that returns an exit status instead of exiting, flag validation, the
//! address file launchers poll, and graceful stop on SIGTERM and SIGINT.

use std::ffi::OsString;
use std::fmt::Display;
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;

/// The parsed arguments, or the exit status after clap printed help, the version (0) or a
/// usage error (2). Never exits the process.
pub fn parse_args<A, I, T>(args: I) -> Result<A, u8>
where
    A: clap::Parser,
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    A::try_parse_from(args).map_err(|e| {
        // Help and version go to stdout with status 0, usage errors to stderr with 2.
        let _ = e.print();
        let _ = std::io::stdout().flush();
        u8::try_from(e.exit_code()).unwrap_or(2)
    })
}

/// A duration flag that is not a positive number of seconds.
#[derive(Clone, Debug, Error, PartialEq)]
#[error("{flag} must be a positive number of seconds (got {secs})")]
pub struct NotPositiveSeconds {
    pub flag: &'static str,
    pub secs: f64,
}

/// `secs` as a positive duration, or an error naming `flag`.
pub fn positive_seconds(flag: &'static str, secs: f64) -> Result<Duration, NotPositiveSeconds> {
    match Duration::try_from_secs_f64(secs) {
        Ok(d) if !d.is_zero() => Ok(d),
        _ => Err(NotPositiveSeconds { flag, secs }),
    }
}

/// Writes `addr` alone (no newline) to `path` through a temporary file renamed into place,
/// so a launcher polling for the file never reads half of it.
pub fn write_addr_file(path: &Path, addr: impl Display) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, addr.to_string())?;
    std::fs::rename(&tmp, path)
}

/// SIGTERM and SIGINT, caught while this lives: they set a flag instead of killing the
/// process. Dropping it removes the handlers; the signals' default actions are not put back
/// (see `signal_hook::low_level::unregister`).
#[derive(Debug)]
pub struct StopSignals {
    requested: Arc<AtomicBool>,
    ids: Vec<signal_hook::SigId>,
    /// Signals that could not be caught, with why.
    pub unhandled: Vec<(i32, std::io::Error)>,
}

impl StopSignals {
    pub fn install() -> StopSignals {
        let requested = Arc::new(AtomicBool::new(false));
        let mut ids = Vec::new();
        let mut unhandled = Vec::new();
        for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
            match signal_hook::flag::register(sig, Arc::clone(&requested)) {
                Ok(id) => ids.push(id),
                Err(e) => unhandled.push((sig, e)),
            }
        }
        StopSignals {
            requested,
            ids,
            unhandled,
        }
    }

    /// Whether a stop signal has arrived.
    pub fn requested(&self) -> bool {
        self.requested.load(Ordering::Relaxed)
    }

    /// Forgets the signals so far, so that [`requested`](Self::requested) tells of the
    /// next one (a program that stops gracefully on the first and at once on a second).
    pub fn clear(&self) {
        self.requested.store(false, Ordering::Relaxed);
    }
}

impl Drop for StopSignals {
    fn drop(&mut self) {
        for id in self.ids.drain(..) {
            signal_hook::low_level::unregister(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_must_be_positive_and_finite() {
        assert_eq!(
            positive_seconds("--t", 1.5),
            Ok(Duration::from_millis(1500))
        );
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let e = positive_seconds("--t", bad).unwrap_err();
            assert!(
                e.to_string()
                    .starts_with("--t must be a positive number of seconds"),
                "{e}"
            );
        }
    }

    #[test]
    fn the_addr_file_is_whole_and_the_temporary_file_gone() {
        let dir = std::env::temp_dir().join(format!("sumflow-addr-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("addr");
        write_addr_file(&path, "127.0.0.1:9000").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "127.0.0.1:9000");
        assert!(!dir.join("addr.tmp").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
