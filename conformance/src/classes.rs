//! Tessera's DeviceClasses as `deploy/deviceclasses.yaml` writes them, for
//! a driver domain of a test's own (`tessera.dev` replaced), so a test's
//! classes select only its own driver's devices and its extended resource
//! names are its own.

use anyhow::{Context, Result};
use k8s_openapi::api::resource::v1::DeviceClass;
use serde::Deserialize;

const DEPLOYED: &str = include_str!("../../deploy/deviceclasses.yaml");

/// Every class of `deploy/deviceclasses.yaml`, with `tessera.dev` replaced
/// by `domain` (names, driver, attribute domain, extended resource names).
pub fn deploy_classes(domain: &str) -> Result<Vec<DeviceClass>> {
    let text = DEPLOYED.replace("tessera.dev", domain);
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| {
            DeviceClass::deserialize(doc).context("a DeviceClass of deploy/deviceclasses.yaml")
        })
        .collect()
}
