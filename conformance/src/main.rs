//! `tessera-conformance`: runs the KAR-0003 GPU-sharing checks against the
//! cluster of a kubeconfig. Exit status 0 iff every check passed (or was
//! skipped with a reason), 1 otherwise, 2 on a usage error.

use clap::Parser;
use tessera_conformance::suite::{self, Args};

#[tokio::main]
async fn main() {
    let args = Args::parse();
    match suite::run(args).await {
        Ok(true) => std::process::exit(0),
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("tessera-conformance: error: {e:#}");
            std::process::exit(1);
        }
    }
}
