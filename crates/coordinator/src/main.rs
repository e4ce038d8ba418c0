//! `sumflow-coordinator`: the rendezvous process of one sumflow job. The program itself is
//! [`sumflow_coordinator::cli::run`], shared with the Python package.

fn main() -> std::process::ExitCode {
    sumflow_coordinator::cli::run(std::env::args_os()).into()
}
