//! hearth-client
