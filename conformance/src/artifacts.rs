//! The built `tessera` binary and the simulated `libnvidia-ml.so.1`, for
//! tests that run Tessera as a process.
//!
//! A test crate cannot depend on a binary, so both are built with cargo on
//! first use (a no-op when `cargo test --workspace` built them already), and
//! their paths are taken from cargo's own report rather than guessed.
//! `TESSERA_BIN` and `TESSERA_FAKE_NVML_LIB` point at prebuilt ones instead.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use serde_json::Value;

pub struct Binaries {
    /// The `tessera` executable.
    pub tessera: PathBuf,
    /// The fake NVML cdylib, for `--nvml-library`.
    pub fake_nvml: PathBuf,
    /// A directory holding it as `libnvidia-ml.so.1`, for `LD_LIBRARY_PATH`.
    pub fake_nvml_dir: PathBuf,
}

pub fn binaries() -> &'static Binaries {
    static BINS: OnceLock<Binaries> = OnceLock::new();
    BINS.get_or_init(|| {
        let (tessera, fake_nvml) = match (
            std::env::var_os("TESSERA_BIN"),
            std::env::var_os("TESSERA_FAKE_NVML_LIB"),
        ) {
            (Some(bin), Some(lib)) => (PathBuf::from(bin), PathBuf::from(lib)),
            _ => build(),
        };
        let dir = fake_nvml
            .parent()
            .unwrap_or(Path::new("."))
            .join("fake-nvml");
        std::fs::create_dir_all(&dir).expect("creating the fake NVML directory");
        // Replace atomically: another test binary may use the link now.
        let tmp = dir.join(format!(".libnvidia-ml.so.1.{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&fake_nvml, &tmp).expect("linking the fake NVML");
        std::fs::rename(&tmp, dir.join("libnvidia-ml.so.1")).expect("placing the fake NVML");
        Binaries {
            tessera,
            fake_nvml,
            fake_nvml_dir: dir,
        }
    })
}

fn build() -> (PathBuf, PathBuf) {
    let out = Command::new(env!("CARGO"))
        .args([
            "build",
            "-p",
            "tessera-driver",
            "-p",
            "tessera-fake-nvml",
            // The tessera binary and the fake's cdylib (a `--bin` alone
            // would filter the library out).
            "--bin",
            "tessera",
            "--lib",
            "--message-format=json",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("running cargo build");
    assert!(
        out.status.success(),
        "cargo build of tessera / tessera-fake-nvml failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut tessera = None;
    let mut lib = None;
    for msg in String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact")
    {
        if msg["target"]["name"] == "tessera"
            && let Some(exe) = msg["executable"].as_str()
        {
            tessera = Some(PathBuf::from(exe));
        }
        if msg["target"]["name"] == "tessera_fake_nvml" {
            lib = msg["filenames"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .find(|f| f.ends_with(".so"))
                .map(PathBuf::from)
                .or(lib);
        }
    }
    (
        tessera.expect("cargo reported no tessera executable"),
        lib.expect("cargo reported no libtessera_fake_nvml.so"),
    )
}
