//! `sumflow-server`: lends a machine's CPU cores and NIC to a job as a summation server.
//! The program itself is [`sumflow_summation::cli::run`], shared with the Python package.

fn main() -> std::process::ExitCode {
    sumflow_summation::cli::run(std::env::args_os()).into()
}
