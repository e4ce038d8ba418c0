//! The `sumflow-coordinator` binary: help, configuration errors, and SIGTERM.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const TOKEN: &str = "coordinator-binary-test-token";

fn coordinator() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_sumflow-coordinator"));
    c.env_remove("SUMFLOW_JOB_TOKEN")
        .env_remove("SUMFLOW_JOB_TOKEN_FILE")
        .env_remove("SUMFLOW_NUM_WORKERS")
        .env_remove("SUMFLOW_NUM_SERVERS")
        .env("RUST_LOG", "info");
    c
}

#[test]
fn help_describes_the_flags() {
    let out = coordinator().arg("--help").output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--workers",
        "--servers",
        "--heartbeat-timeout",
        "--addr-file",
        "SUMFLOW_",
    ] {
        assert!(help.contains(flag), "--help lacks {flag}:\n{help}");
    }
}

#[test]
fn configuration_errors_exit_2_with_the_reason() {
    let out = coordinator()
        .args(["--workers", "0"])
        .env("SUMFLOW_JOB_TOKEN", TOKEN)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("at least 1 worker"), "{err}");

    let out = coordinator().args(["--workers", "2"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no job token"), "{err}");
}

#[test]
fn stops_cleanly_on_sigterm() {
    let dir = std::env::temp_dir().join(format!("sumflow-coord-bin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let addr_file = dir.join("addr");
    let mut child = coordinator()
        .args(["--bind", "127.0.0.1:0", "--workers", "2", "--addr-file"])
        .arg(&addr_file)
        .env("SUMFLOW_JOB_TOKEN", TOKEN)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::read_to_string(&addr_file).map_or(true, |s| s.is_empty()) {
        assert!(Instant::now() < deadline, "no address written");
        std::thread::sleep(Duration::from_millis(20));
    }
    let addr = std::fs::read_to_string(&addr_file).unwrap();
    assert!(
        std::net::TcpStream::connect(addr.trim()).is_ok(),
        "listening at {addr}"
    );
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "still running 10 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "exit status {status}");
    let _ = std::fs::remove_dir_all(&dir);
}
