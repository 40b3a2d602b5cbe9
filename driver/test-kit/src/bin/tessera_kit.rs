//! `tessera-kit`: the test kit's pieces for scripts (`conformance/cluster.sh`).
//!
//! `tessera-kit driver-root ROOT --fakes DIR --tessera BIN` builds the
//! simulated node's driver root at ROOT from the fakes in cargo's profile
//! directory DIR, asking `BIN inventory` which GPUs the machine has (the
//! simulated machine's `TESSERA_FAKE_NVML_*` variables come from this
//! process's environment; that first call also seeds the machine's state
//! and capability files), and prints how many GPUs it has.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use tessera_test_kit::driver_root::{DriverRootBuilder, Fakes, NVML, inventory_minors};

const USAGE: &str = "usage: tessera-kit driver-root ROOT --fakes DIR --tessera BIN";

fn main() -> ExitCode {
    match run(std::env::args().skip(1).collect()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tessera-kit: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Vec<String>) -> Result<()> {
    match args.split_first() {
        Some((command, rest)) if command == "driver-root" => driver_root(rest),
        _ => bail!("{USAGE}"),
    }
}

fn driver_root(args: &[String]) -> Result<()> {
    let mut root = None;
    let mut fakes = None;
    let mut tessera = None;
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let mut value = || args.next().cloned().map(PathBuf::from).context(USAGE);
        match arg.as_str() {
            "--fakes" => fakes = Some(value()?),
            "--tessera" => tessera = Some(value()?),
            _ if root.is_none() && !arg.starts_with('-') => root = Some(PathBuf::from(arg)),
            _ => bail!("unknown argument {arg:?}; {USAGE}"),
        }
    }
    let (Some(root), Some(fakes), Some(tessera)) = (root, fakes, tessera) else {
        bail!("{USAGE}");
    };
    let fakes = Fakes::in_profile_dir(&fakes)?;
    let built = DriverRootBuilder::simulated(&fakes)
        .gpus_asked(|root| inventory_minors(&tessera, &root.join(NVML), &[]))
        .build(&root)?;
    println!("{}", built.gpus.len());
    Ok(())
}
