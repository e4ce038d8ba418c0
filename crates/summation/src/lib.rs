//! The summation service (BytePS §5): sums pushed gradient partitions and returns
//! each round's sum to every worker that pulls it. It never runs an optimizer.

pub mod buffer;
pub mod reduce;
