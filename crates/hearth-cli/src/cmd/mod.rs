//! One module per group of commands. Each function returns the process exit status.

pub mod buckets;
pub mod exec;
pub mod files;
pub mod inspect;
pub mod mcp;
pub mod net;
pub mod sandbox;
pub mod shell;
pub mod storage;
pub mod system;
pub mod tenancy;
