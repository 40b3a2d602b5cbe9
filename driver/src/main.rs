//! `tessera`: the Tessera node daemon and tools.

fn main() {}
