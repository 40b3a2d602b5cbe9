//! Driver and runtime management (KAR-0001 of the CNCF AI conformance
//! program): a pod given one GPU sees exactly that one `/dev/nvidia<N>`, and
//! its `nvidia-smi` reports the driver version and the CUDA version that the
//! driver publishes for the device in its ResourceSlices (`driverVersion`,
//! `cudaDriverVersion`, the names NVIDIA's DRA driver uses), so what the
//! scheduler selects on is what the workload runs with.

use anyhow::Result;
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;

use super::Ctx;
use super::checks::{Outcome, count_verdict, gpu_template, lookup, run_pods};
use super::facts::SliceDevice;
use super::probe::{ClaimSource, ProbeOutput, ProbePod};

const CHECK: &str = "driver-versions";
/// Slice attributes (without the driver's domain).
const DRIVER_VERSION: &str = "driverVersion";
const CUDA_DRIVER_VERSION: &str = "cudaDriverVersion";

pub async fn driver_versions(ctx: &Ctx) -> Result<Outcome> {
    ctx.kube
        .create::<ResourceClaimTemplate>(gpu_template(ctx, CHECK, "versions-gpu"))
        .await?;
    let pod = ProbePod::single(
        "driver-versions",
        CHECK,
        &ctx.node,
        &ctx.image,
        Some(ClaimSource::Template("versions-gpu".into())),
    );
    let runs = run_pods(ctx, CHECK, &[pod]).await?;
    let run = &runs[0];
    let allocated = ctx.kube.allocated(&run.pod).await?;
    let device = allocated.first().and_then(|a| lookup(ctx, a));
    let out = run.output();
    let details = vec![format!(
        "pod driver-versions (1-device claim of {}): {}; nvidia-smi: {}; device {}",
        ctx.classes.gpu,
        out.summary(),
        out.versions.as_deref().unwrap_or("no version row"),
        device.map_or("not in the slices".to_owned(), |d| format!(
            "{} publishes {DRIVER_VERSION} {} and {CUDA_DRIVER_VERSION} {}",
            d.name,
            d.attr(DRIVER_VERSION).unwrap_or("(none)"),
            d.attr(CUDA_DRIVER_VERSION).unwrap_or("(none)")
        ))
    )];
    Ok(match verdict(out, device) {
        Ok(m) => Outcome::pass(m, details),
        Err(m) => Outcome::fail(m, details),
    })
}

/// One device node, and `nvidia-smi`'s versions equal to the device's.
pub fn verdict(out: &ProbeOutput, device: Option<&SliceDevice>) -> Result<String, String> {
    let seen = count_verdict("pod driver-versions with a 1-device claim", 1, out)?;
    let device = device.ok_or("its claim's device is in none of the driver's ResourceSlices")?;
    let (driver, cuda) = out.driver_versions().ok_or(
        "nvidia-smi in the pod printed no row naming the driver version and the CUDA version",
    )?;
    for (attr, reported) in [(DRIVER_VERSION, &driver), (CUDA_DRIVER_VERSION, &cuda)] {
        let published = device
            .attr(attr)
            .ok_or_else(|| format!("device {} publishes no attribute {attr}", device.name))?;
        if !same_version(published, reported) {
            return Err(format!(
                "nvidia-smi in the pod reports {reported} where device {} publishes {attr} {published}",
                device.name
            ));
        }
    }
    Ok(format!(
        "{seen}; its nvidia-smi reports driver {driver} and CUDA {cuda}, as device {} publishes",
        device.name
    ))
}

/// Versions compared as numbers, missing parts as 0: slices carry semantic
/// versions (`550.90.7`, `12.4.0`) of what `nvidia-smi` prints as
/// `550.90.07` and `12.4`.
pub fn same_version(a: &str, b: &str) -> bool {
    let parts = |v: &str| -> Option<Vec<u64>> {
        let mut p: Vec<u64> = v
            .trim()
            .split('.')
            .map(|x| x.parse().ok())
            .collect::<Option<_>>()?;
        while p.len() < 3 {
            p.push(0);
        }
        Some(p)
    };
    matches!((parts(a), parts(b)), (Some(x), Some(y)) if x == y)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn device(driver: &str, cuda: &str) -> SliceDevice {
        SliceDevice {
            name: "gpu-0".into(),
            pool: "node".into(),
            slice: "s".into(),
            node: Some("node".into()),
            attrs: BTreeMap::from([
                (DRIVER_VERSION.into(), driver.into()),
                (CUDA_DRIVER_VERSION.into(), cuda.into()),
            ]),
            capacity: BTreeMap::new(),
            multi: false,
        }
    }

    fn probe(count: u32, row: Option<&str>) -> ProbeOutput {
        let mut log = format!("RESULT: ACCELERATOR_COUNT={count}\n");
        if let Some(row) = row {
            log += &format!("SMI-VERSIONS: {row}\n");
        }
        ProbeOutput::parse(&(log + "PROBE: DONE\n"))
    }

    const ROW: &str =
        "| NVIDIA-SMI 550.90.07     Driver Version: 550.90.07     CUDA Version: 12.4     |";

    #[test]
    fn versions_as_published_pass() {
        let ok = verdict(&probe(1, Some(ROW)), Some(&device("550.90.7", "12.4.0")));
        assert!(ok.unwrap().contains("driver 550.90.07 and CUDA 12.4"));
    }

    #[test]
    fn each_failure_names_what_differs() {
        let d = device("550.90.7", "12.4.0");
        let other_cuda = verdict(&probe(1, Some(ROW)), Some(&device("550.90.7", "12.8.0")));
        assert!(
            other_cuda
                .unwrap_err()
                .contains("12.4 where device gpu-0 publishes cudaDriverVersion 12.8.0")
        );
        let other_driver = verdict(&probe(1, Some(ROW)), Some(&device("570.86.15", "12.4.0")));
        assert!(
            other_driver
                .unwrap_err()
                .contains("driverVersion 570.86.15")
        );
        let two = verdict(&probe(2, Some(ROW)), Some(&d)).unwrap_err();
        assert!(two.contains("sees 2 /dev/nvidia[0-9]*"), "{two}");
        let silent = verdict(&probe(1, None), Some(&d)).unwrap_err();
        assert!(silent.contains("printed no row"), "{silent}");
        assert!(verdict(&probe(1, Some(ROW)), None).is_err());
    }

    #[test]
    fn versions_compare_as_numbers() {
        assert!(same_version("550.90.7", "550.90.07"));
        assert!(same_version("12.4.0", "12.4"));
        assert!(!same_version("12.4.0", "12.41"));
        assert!(!same_version("12.4", "N/A"));
    }
}
