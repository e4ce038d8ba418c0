//! Why a simulation did not run.

use sumflow_plan::lanes::LaneError;
use sumflow_plan::layout::LayoutError;
use sumflow_plan::partition::PartitionError;
use sumflow_plan::placement::PlacementError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum SimError {
    /// The configuration cannot be simulated; the sentence names the field.
    #[error("{0}")]
    Invalid(String),
    #[error("the configuration is not valid JSON for a simulation: {0}")]
    Json(#[from] serde_json::Error),
    #[error("cutting the model into partitions: {0}")]
    Partition(#[from] PartitionError),
    #[error("placing partitions on summation servers: {0}")]
    Placement(#[from] PlacementError),
    #[error(transparent)]
    Lanes(#[from] LaneError),
    /// The simulation stopped making progress: a bug, reported with where it stood.
    #[error("the simulation stalled at {at_s:.6} s in iteration {iteration}: {what}")]
    Stalled {
        at_s: f64,
        iteration: u32,
        what: String,
    },
}

/// A layout's error as the step that failed: cutting, placing, or cutting into pieces.
impl From<LayoutError> for SimError {
    fn from(e: LayoutError) -> Self {
        match e {
            LayoutError::Partition(e) => e.into(),
            LayoutError::Placement(e) => e.into(),
            LayoutError::Lanes(e) => e.into(),
        }
    }
}
