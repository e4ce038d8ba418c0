//! The `sumflow-server` binary: help, configuration errors, serving, and SIGTERM.

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const TOKEN: &str = "binary-test-token-0123456789";

fn server() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_sumflow-server"));
    c.env_remove("SUMFLOW_JOB_TOKEN")
        .env_remove("SUMFLOW_JOB_TOKEN_FILE")
        .env_remove("SUMFLOW_COORDINATOR")
        .env_remove("SUMFLOW_NUM_WORKERS")
        .env("RUST_LOG", "info");
    c
}

fn wait_timeout(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    None
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn help_describes_the_flags() {
    let out = server().arg("--help").output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--coordinator",
        "--workers",
        "--engine-threads",
        "--token-file",
        "SUMFLOW_",
    ] {
        assert!(help.contains(flag), "--help lacks {flag}:\n{help}");
    }
}

#[test]
fn configuration_errors_are_one_clear_line_and_exit_2() {
    let out = server().args(["--workers", "2"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("no job token"), "{}", stderr(&out));

    let out = server()
        .args(["--workers", "0"])
        .env("SUMFLOW_JOB_TOKEN", TOKEN)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("at least 1"), "{}", stderr(&out));

    let out = server().env("SUMFLOW_JOB_TOKEN", TOKEN).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
}

#[test]
fn serves_then_stops_gracefully_on_sigterm() {
    let dir = std::env::temp_dir().join(format!("sumflow-bin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let addr_file: PathBuf = dir.join("addr");
    let token_file = dir.join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let mut child = server()
        .args(["--workers", "1", "--token-file"])
        .arg(&token_file)
        .arg("--addr-file")
        .arg(&addr_file)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !addr_file.exists() || std::fs::read_to_string(&addr_file).unwrap().is_empty() {
        assert!(
            Instant::now() < deadline,
            "server did not write its address"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let addr = std::fs::read_to_string(&addr_file).unwrap();
    let token = sumflow_wire::JobToken::new(TOKEN).unwrap();
    let mut c = sumflow_client::ServerClient::connect(
        &addr,
        &token,
        0,
        "binary test",
        &sumflow_client::ServerOptions::default(),
    )
    .unwrap();
    c.init_key(1, sumflow_wire::Dtype::I32, 4, None).unwrap();
    let p = c
        .push_pull(1, 1, sumflow_wire::Dtype::I32, &41i32.to_le_bytes())
        .unwrap();
    assert_eq!(p.data, 41i32.to_le_bytes());

    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = wait_timeout(&mut child, Duration::from_secs(10)).expect("exits after SIGTERM");
    assert!(exit.success(), "exit status {exit}");
    let mut log = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut log).unwrap();
    assert!(log.contains("summation server stopped"), "{log}");
    // The connected worker learns that the server is gone instead of hanging.
    assert!(c.heartbeat(1).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}
