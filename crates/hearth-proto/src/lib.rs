//! hearth-proto
