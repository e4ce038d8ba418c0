//! Coordinator.
