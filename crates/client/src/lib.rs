//! Blocking clients for sumflow's summation service and coordinator: used by the tests
//! and, underneath its pipeline, by the worker's communication service.

pub mod coordinator;
mod dial;
pub mod error;
pub mod link;
mod low_water;
pub mod mailbox;
mod nic;
pub mod server;

pub use coordinator::CoordinatorClient;
pub use error::{ClientError, Result};
pub use server::{Pulled, Reply, ServerClient, ServerOptions, SumHeader};
