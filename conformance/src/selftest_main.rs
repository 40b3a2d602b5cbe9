//! `tessera-selftest`: whether Isolated GPU shares hold on this node against
//! a hostile tenant (see `conformance/gpu-selftest.sh`, which starts the
//! control plane it needs). Exit status 0 iff every step held, 1 otherwise.

use clap::Parser;
use tessera_conformance::selftest::{self, Args};

#[tokio::main]
async fn main() {
    let args = Args::parse();
    match selftest::run(&args).await {
        Ok(true) => std::process::exit(0),
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("tessera-selftest: error: {e:#}");
            std::process::exit(1);
        }
    }
}
