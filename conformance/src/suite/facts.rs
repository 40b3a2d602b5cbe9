//! Cluster facts the checks build on: the driver's devices on a node, which
//! physical GPU each one belongs to, and which devices a DeviceClass selects.
//!
//! A device's physical GPU is its `parentUUID` attribute where it has one (MIG
//! and share devices) and its `uuid` otherwise (a whole GPU). Tessera and
//! NVIDIA's DRA driver (`gpu.nvidia.com`) publish the same names.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{Device, DeviceAttribute, ResourceSlice};

/// Attribute carrying a device's own UUID (GPU or MIG UUID).
pub const UUID: &str = "uuid";
/// Attribute carrying the physical GPU's UUID on MIG and share devices.
pub const PARENT_UUID: &str = "parentUUID";
/// Attribute naming the kind of device (`gpu` | `mig` | `share`).
pub const TYPE: &str = "type";

/// One consumable capacity of a device and how a claim may ask for it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Capacity {
    pub value: u128,
    /// What a claim that does not ask consumes (`requestPolicy.default`).
    pub default: Option<u128>,
    pub min: Option<u128>,
    pub step: Option<u128>,
    /// Whether the capacity is consumable (has a request policy).
    pub consumable: bool,
}

/// A device of the driver, flattened from its slice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceDevice {
    pub name: String,
    pub pool: String,
    pub slice: String,
    pub node: Option<String>,
    /// Attribute values as strings, keys without the driver's domain.
    pub attrs: BTreeMap<String, String>,
    pub capacity: BTreeMap<String, Capacity>,
    pub multi: bool,
}

impl SliceDevice {
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attrs.get(key).map(String::as_str)
    }

    /// UUID of the physical GPU this device belongs to.
    pub fn physical_gpu(&self) -> Option<&str> {
        self.attr(PARENT_UUID).or_else(|| self.attr(UUID))
    }

    /// Name of the attribute that carries the physical GPU's UUID on this device.
    pub fn physical_attr(&self) -> Option<&'static str> {
        if self.attrs.contains_key(PARENT_UUID) {
            Some(PARENT_UUID)
        } else if self.attrs.contains_key(UUID) {
            Some(UUID)
        } else {
            None
        }
    }

    /// `pool/device`, as allocation results name it.
    pub fn id(&self) -> String {
        format!("{}/{}", self.pool, self.name)
    }
}

/// Parses a Kubernetes quantity into whole units (fractions round up).
pub fn parse_quantity(q: &str) -> Option<u128> {
    let q = q.trim();
    let split = q
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
        .unwrap_or(q.len());
    let (num, suffix) = q.split_at(split);
    let (mul, div): (u128, u128) = match suffix {
        "" => (1, 1),
        "Ki" => (1 << 10, 1),
        "Mi" => (1 << 20, 1),
        "Gi" => (1 << 30, 1),
        "Ti" => (1 << 40, 1),
        "Pi" => (1 << 50, 1),
        "Ei" => (1 << 60, 1),
        "k" => (1_000, 1),
        "M" => (1_000_000, 1),
        "G" => (1_000_000_000, 1),
        "T" => (1_000_000_000_000, 1),
        "P" => (1_000_000_000_000_000, 1),
        "E" => (1_000_000_000_000_000_000, 1),
        "m" => (1, 1_000),
        "u" => (1, 1_000_000),
        "n" => (1, 1_000_000_000),
        s if s.starts_with(['e', 'E']) => (10u128.checked_pow(s[1..].parse().ok()?)?, 1),
        _ => return None,
    };
    let num = num.strip_prefix('+').unwrap_or(num);
    if num.starts_with('-') {
        return None;
    }
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if int.is_empty() && frac.is_empty() {
        return None;
    }
    let scale = 10u128.checked_pow(u32::try_from(frac.len()).ok()?)?;
    let whole: u128 = if int.is_empty() { 0 } else { int.parse().ok()? };
    let frac_v: u128 = if frac.is_empty() {
        0
    } else {
        frac.parse().ok()?
    };
    let numer = (whole * scale + frac_v).checked_mul(mul)?;
    let denom = scale * div;
    Some(numer.div_ceil(denom))
}

/// A quantity in the largest binary unit that divides it (`20Gi`, `100`).
pub fn format_quantity(v: u128) -> String {
    for (suffix, unit) in [
        ("Ti", 1u128 << 40),
        ("Gi", 1 << 30),
        ("Mi", 1 << 20),
        ("Ki", 1 << 10),
    ] {
        if v >= unit && v.is_multiple_of(unit) {
            return format!("{}{suffix}", v / unit);
        }
    }
    v.to_string()
}

fn attr_string(a: &DeviceAttribute) -> Option<String> {
    a.string
        .clone()
        .or_else(|| a.version.clone())
        .or_else(|| a.int.map(|i| i.to_string()))
        .or_else(|| a.bool.map(|b| b.to_string()))
}

fn flatten_device(
    d: &Device,
    driver: &str,
) -> (BTreeMap<String, String>, BTreeMap<String, Capacity>) {
    let prefix = format!("{driver}/");
    let attrs = d
        .attributes
        .iter()
        .flatten()
        .filter_map(|(k, v)| {
            let key = k.strip_prefix(&prefix).unwrap_or(k);
            Some((key.to_owned(), attr_string(v)?))
        })
        .collect();
    let capacity = d
        .capacity
        .iter()
        .flatten()
        .filter_map(|(k, c)| {
            let key = k.strip_prefix(&prefix).unwrap_or(k).to_owned();
            let policy = c.request_policy.as_ref();
            let range = policy.and_then(|p| p.valid_range.as_ref());
            let cap = Capacity {
                value: parse_quantity(&c.value.0)?,
                default: policy
                    .and_then(|p| p.default.as_ref())
                    .and_then(|q| parse_quantity(&q.0)),
                min: range.and_then(|r| parse_quantity(&r.min.0)),
                step: range
                    .and_then(|r| r.step.as_ref())
                    .and_then(|q| parse_quantity(&q.0)),
                consumable: policy.is_some(),
            };
            Some((key, cap))
        })
        .collect();
    (attrs, capacity)
}

/// The devices of `driver` in `slices`, on `node` when given.
pub fn devices_of(slices: &[ResourceSlice], driver: &str, node: Option<&str>) -> Vec<SliceDevice> {
    let mut out = Vec::new();
    for s in slices {
        if s.spec.driver != driver {
            continue;
        }
        let slice_node = s.spec.node_name.clone();
        if node.is_some() && slice_node.as_deref() != node {
            continue;
        }
        for d in s.spec.devices.iter().flatten() {
            let (attrs, capacity) = flatten_device(d, driver);
            out.push(SliceDevice {
                name: d.name.clone(),
                pool: s.spec.pool.name.clone(),
                slice: s.metadata.name.clone().unwrap_or_default(),
                node: slice_node.clone(),
                attrs,
                capacity,
                multi: d.allow_multiple_allocations.unwrap_or(false),
            });
        }
    }
    out
}

/// Nodes that have slices of `driver` with devices, sorted by name.
pub fn nodes_with_devices(slices: &[ResourceSlice], driver: &str) -> Vec<String> {
    let mut nodes: Vec<String> = slices
        .iter()
        .filter(|s| {
            s.spec.driver == driver && s.spec.devices.as_ref().is_some_and(|d| !d.is_empty())
        })
        .filter_map(|s| s.spec.node_name.clone())
        .collect();
    nodes.sort();
    nodes.dedup();
    nodes
}

/// Devices grouped by the physical GPU they belong to (devices without a
/// UUID attribute are left out).
pub fn by_physical_gpu(devices: &[SliceDevice]) -> BTreeMap<String, Vec<&SliceDevice>> {
    let mut groups: BTreeMap<String, Vec<&SliceDevice>> = BTreeMap::new();
    for d in devices {
        if let Some(gpu) = d.physical_gpu() {
            groups.entry(gpu.to_owned()).or_default().push(d);
        }
    }
    groups
}

/// How many claims can be allocated at once from one logical device: the
/// number of times `request` (per capacity; the default where not asked)
/// fits, or 1 for an exclusive device. `u128::MAX` for a multi-allocatable
/// device without consumable capacity (nothing limits it).
pub fn claims_per_device(d: &SliceDevice, request: &BTreeMap<String, u128>) -> u128 {
    if !d.multi {
        return 1;
    }
    d.capacity
        .iter()
        .filter(|(_, c)| c.consumable)
        .filter_map(|(name, c)| {
            let want = request.get(name).copied().or(c.default).or(c.min)?;
            Some(c.value / valid_request(c, want).max(1))
        })
        .min()
        .unwrap_or(u128::MAX)
}

/// What the scheduler charges for a request of `want`: rounded up to
/// `min + k * step`.
pub fn valid_request(c: &Capacity, want: u128) -> u128 {
    let min = c.min.unwrap_or(0);
    if want <= min {
        return min.max(want);
    }
    match c.step {
        Some(s) if s > 0 => min + (want - min).div_ceil(s) * s,
        _ => want,
    }
}

/// A request for capacity `name` of `d` such that at most two claims fit
/// on it (half the capacity, rounded up to a valid request): keeps the
/// number of pods an over-allocation check needs small. `None` when `d` has
/// no consumable `name`.
pub fn half_request(d: &SliceDevice, name: &str) -> Option<u128> {
    let c = d.capacity.get(name).filter(|c| c.consumable)?;
    let half = valid_request(c, c.value.div_ceil(2));
    (half <= c.value).then_some(half)
}

/// The attribute equalities of a DeviceClass CEL selector, e.g.
/// `device.attributes["gpu.tessera.dev"].type == "share"` gives
/// `("type", "share")`; clauses it does not understand are ignored.
pub fn selector_equalities(expression: &str) -> Vec<(String, String)> {
    expression
        .split("&&")
        .filter_map(|clause| {
            let clause = clause.trim().trim_matches(|c| c == '(' || c == ')').trim();
            let (lhs, rhs) = clause.split_once("==")?;
            let lhs = lhs.trim();
            let rest = lhs.strip_prefix("device.attributes[")?;
            let (_, attr) = rest.split_once("].")?;
            let value = rhs.trim().trim_matches(|c| c == '"' || c == '\'');
            let attr = attr.trim();
            if attr.is_empty() || !attr.chars().all(|c| c.is_alphanumeric() || c == '_') {
                return None;
            }
            Some((attr.to_owned(), value.to_owned()))
        })
        .collect()
}

/// Whether `d` satisfies every equality of a class's selectors.
pub fn matches_class(d: &SliceDevice, equalities: &[(String, String)]) -> bool {
    equalities
        .iter()
        .all(|(k, v)| d.attr(k) == Some(v.as_str()))
}

/// A CEL expression that pins a request of `driver` to the physical GPU
/// `uuid`, through the attribute `attr` (`uuid` or `parentUUID`).
pub fn pin_expression(driver: &str, attr: &str, uuid: &str) -> String {
    format!("device.attributes[\"{driver}\"].{attr} == \"{uuid}\"")
}

/// Tessera's DeviceClasses (deploy/deviceclasses.yaml) for `driver`, as
/// `(name, CEL expression)`: the whole GPU, MIG and Shared-share classes.
pub fn tessera_classes(driver: &str) -> Vec<(String, String)> {
    let domain = class_domain(driver);
    let base = format!("device.driver == \"{driver}\" && device.attributes[\"{driver}\"].type == ");
    vec![
        (format!("gpu.{domain}"), format!("{base}\"gpu\"")),
        (format!("mig.{domain}"), format!("{base}\"mig\"")),
        (
            format!("gpu-shared.{domain}"),
            format!(
                "{base}\"share\" && device.attributes[\"{driver}\"].isolationLevel == \"Shared\""
            ),
        ),
    ]
}

/// The DeviceClass domain of a driver name: `gpu.tessera.dev` → `tessera.dev`.
pub fn class_domain(driver: &str) -> &str {
    tessera_api::classes::domain(driver)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn slice(node: &str, devices: serde_json::Value) -> ResourceSlice {
        serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": format!("{node}-slice")},
            "spec": {"driver": "gpu.tessera.dev", "nodeName": node,
                     "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "devices": devices}
        }))
        .unwrap()
    }

    fn sample() -> Vec<ResourceSlice> {
        vec![
            slice(
                "n1",
                json!([
                    {"name": "gpu-0", "attributes": {"type": {"string": "gpu"}, "uuid": {"string": "GPU-a"}}},
                    {"name": "gpu-0-shared", "allowMultipleAllocations": true,
                     "attributes": {"type": {"string": "share"}, "uuid": {"string": "GPU-a"},
                                    "parentUUID": {"string": "GPU-a"}, "isolationLevel": {"string": "Shared"}},
                     "capacity": {
                        "memory": {"value": "40Gi", "requestPolicy": {"default": "1Gi",
                                   "validRange": {"min": "256Mi", "step": "256Mi"}}},
                        "cores": {"value": "100", "requestPolicy": {"default": "10",
                                   "validRange": {"min": "1", "step": "1"}}}}},
                    {"name": "gpu-1-mig-0", "attributes": {"type": {"string": "mig"},
                        "uuid": {"string": "MIG-x"}, "gpu.tessera.dev/parentUUID": {"string": "GPU-b"}}},
                    {"name": "gpu-1-mig-1", "attributes": {"type": {"string": "mig"},
                        "parentUUID": {"string": "GPU-b"}}},
                ]),
            ),
            slice(
                "n2",
                json!([{"name": "gpu-0", "attributes": {"uuid": {"string": "GPU-c"}}}]),
            ),
        ]
    }

    #[test]
    fn groups_devices_by_physical_gpu() {
        let devices = devices_of(&sample(), "gpu.tessera.dev", Some("n1"));
        assert_eq!(devices.len(), 4);
        let groups = by_physical_gpu(&devices);
        let names: Vec<(&str, Vec<&str>)> = groups
            .iter()
            .map(|(g, ds)| (g.as_str(), ds.iter().map(|d| d.name.as_str()).collect()))
            .collect();
        assert_eq!(
            names,
            vec![
                ("GPU-a", vec!["gpu-0", "gpu-0-shared"]),
                ("GPU-b", vec!["gpu-1-mig-0", "gpu-1-mig-1"]),
            ]
        );
        // The qualified attribute name counts as the unqualified one.
        assert_eq!(devices[2].physical_attr(), Some(PARENT_UUID));
        assert_eq!(devices[0].physical_attr(), Some(UUID));
    }

    #[test]
    fn lists_nodes_with_devices() {
        assert_eq!(
            nodes_with_devices(&sample(), "gpu.tessera.dev"),
            vec!["n1", "n2"]
        );
        assert!(nodes_with_devices(&sample(), "gpu.nvidia.com").is_empty());
    }

    #[test]
    fn parses_quantities() {
        assert_eq!(parse_quantity("40Gi"), Some(40 << 30));
        assert_eq!(parse_quantity("100"), Some(100));
        assert_eq!(parse_quantity("1.5k"), Some(1500));
        assert_eq!(parse_quantity("500m"), Some(1));
        assert_eq!(parse_quantity("1e3"), Some(1000));
        assert_eq!(parse_quantity("x"), None);
        assert_eq!(parse_quantity("-1"), None);
        assert_eq!(format_quantity(20 << 30), "20Gi");
        assert_eq!(format_quantity(100), "100");
        assert_eq!(format_quantity((1 << 30) + 1), "1073741825");
    }

    #[test]
    fn counts_claims_per_device() {
        let devices = devices_of(&sample(), "gpu.tessera.dev", Some("n1"));
        let share = &devices[1];
        // Defaults: 40 x 1Gi of memory, 10 x 10% of cores: cores bind.
        assert_eq!(claims_per_device(share, &BTreeMap::new()), 10);
        let half = half_request(share, "memory").unwrap();
        assert_eq!(half, 20 << 30);
        let req = BTreeMap::from([("memory".to_owned(), half), ("cores".to_owned(), 50)]);
        assert_eq!(claims_per_device(share, &req), 2);
        assert_eq!(claims_per_device(&devices[0], &req), 1);
    }

    #[test]
    fn reads_class_selector_equalities() {
        let expr = r#"device.driver == "gpu.tessera.dev" &&
          device.attributes["gpu.tessera.dev"].type == "share" &&
          device.attributes["gpu.tessera.dev"].isolationLevel == "Shared""#;
        let eq = selector_equalities(expr);
        assert_eq!(
            eq,
            vec![
                ("type".into(), "share".into()),
                ("isolationLevel".into(), "Shared".into())
            ]
        );
        let devices = devices_of(&sample(), "gpu.tessera.dev", Some("n1"));
        let selected: Vec<&str> = devices
            .iter()
            .filter(|d| matches_class(d, &eq))
            .map(|d| d.name.as_str())
            .collect();
        assert_eq!(selected, vec!["gpu-0-shared"]);
        let nv = selector_equalities(
            "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'",
        );
        assert_eq!(nv, vec![("type".into(), "gpu".into())]);
    }

    #[test]
    fn derives_class_domain() {
        assert_eq!(class_domain("gpu.tessera.dev"), "tessera.dev");
        assert_eq!(class_domain("example.com"), "example.com");
        assert_eq!(
            pin_expression("gpu.tessera.dev", "uuid", "GPU-a"),
            r#"device.attributes["gpu.tessera.dev"].uuid == "GPU-a""#
        );
    }
}
