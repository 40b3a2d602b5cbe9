//! Compiles the kubelet gRPC protocols in `proto/` into Rust.
//!
//! `protox` parses the `.proto` files in pure Rust, so building Tessera needs
//! no `protoc` on the machine. Clients and servers are both generated; the
//! transport helpers (`connect`) are left out so this crate does not pull in
//! hyper: binaries bring their own transport (unix sockets).

use std::path::Path;

const PROTOS: &[&str] = &[
    "dra/v1/dra.proto",
    "dra/v1beta1/dra.proto",
    "pluginregistration/v1/registration.proto",
    "dra-health/v1alpha1/health.proto",
    "dra-health/v1beta1/health.proto",
    "dra-health/v1/health.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = Path::new("proto");
    println!("cargo:rerun-if-changed=proto");
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={}", root.join(proto).display());
    }

    let fds = protox::compile(PROTOS, [root])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .build_transport(false)
        .compile_fds(fds)?;
    Ok(())
}
