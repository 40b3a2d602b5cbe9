//! What Tessera's tests share, said once: the artifacts cargo builds for
//! them ([`artifacts`]), waits with a deadline ([`wait`]) and the simulated
//! node's driver root ([`driver_root`], also built by the `tessera-kit`
//! binary for `conformance/cluster.sh`).
//!
//! A dev-dependency of the driver and the fakes, and a dependency of the
//! conformance crate (whose self-test binary uses it too). It never depends
//! on `tessera-driver`, so the driver's own unit tests can use it.

pub mod artifacts;
pub mod cluster;
pub mod driver_root;
pub mod gpu_load;
pub mod source;
pub mod wait;

use std::path::Path;

/// The workspace root, where `cargo` is run and shipped files are found.
pub fn repo_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("driver/test-kit sits two levels below the workspace root")
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_repo_root_is_the_workspace() {
        let manifest = std::fs::read_to_string(super::repo_root().join("Cargo.toml")).unwrap();
        assert!(manifest.contains("[workspace]"), "{manifest}");
    }
}
