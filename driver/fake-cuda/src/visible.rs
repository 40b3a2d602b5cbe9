//! `CUDA_VISIBLE_DEVICES`: which of the devices a process could see it
//! enumerates, and in which order.
//!
//! The rules CUDA applies: unset, every device in the default order; set,
//! a comma-separated list whose entries are device indices (into the
//! default order) or UUIDs (`GPU-...`, `MIG-...`, any case) or prefixes of
//! UUIDs that name exactly one device. The list is read up to its first
//! entry that names no device (an out-of-range index, an unknown or
//! ambiguous UUID prefix, anything else, an empty entry): that entry and all
//! after it are ignored. Set but empty, no device at all. This fake also
//! stops at a device named twice, and does not take the old
//! `MIG-GPU-<uuid>/<gi>/<ci>` form.

/// Indices into `uuids` (the default order) of the devices `value` selects,
/// in the order it gives.
pub fn select(value: Option<&str>, uuids: &[&str]) -> Vec<usize> {
    let Some(value) = value else {
        return (0..uuids.len()).collect();
    };
    let mut out = Vec::new();
    if value.trim().is_empty() {
        return out;
    }
    for entry in value.split(',') {
        match resolve(entry, uuids) {
            Some(i) if !out.contains(&i) => out.push(i),
            _ => break,
        }
    }
    out
}

/// The device one entry names, if exactly one.
pub fn resolve(entry: &str, uuids: &[&str]) -> Option<usize> {
    let entry = entry.trim();
    if !entry.is_empty() && entry.bytes().all(|b| b.is_ascii_digit()) {
        let index: usize = entry.parse().ok()?;
        return (index < uuids.len()).then_some(index);
    }
    let is_uuid = ["GPU-", "MIG-"].iter().any(|p| {
        entry.len() > p.len()
            && entry
                .get(..p.len())
                .is_some_and(|h| h.eq_ignore_ascii_case(p))
    });
    if !is_uuid {
        return None;
    }
    let entry = entry.to_ascii_lowercase();
    let mut matches = uuids
        .iter()
        .enumerate()
        .filter(|(_, u)| u.to_ascii_lowercase().starts_with(&entry));
    match (matches.next(), matches.next()) {
        (Some((i, _)), None) => Some(i),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UUIDS: [&str; 4] = [
        "GPU-3d2a07e5-04b3-4312-87c3-c23be8aaee0f",
        "GPU-3da2dd85-937c-4b64-b132-90c221b248d8",
        "MIG-4ed9be02-ad66-4e46-883e-9be7143d655b",
        "GPU-56f203d4-e9c0-4708-918f-09c606609017",
    ];

    fn sel(v: Option<&str>) -> Vec<usize> {
        select(v, &UUIDS)
    }

    #[test]
    fn unset_is_everything_and_empty_is_nothing() {
        assert_eq!(sel(None), vec![0, 1, 2, 3]);
        assert_eq!(sel(Some("")), Vec::<usize>::new());
        assert_eq!(sel(Some("  ")), Vec::<usize>::new());
    }

    #[test]
    fn indices_and_uuids_reorder() {
        assert_eq!(sel(Some("3,0")), vec![3, 0]);
        assert_eq!(sel(Some(" 1 , 2 ")), vec![1, 2]);
        assert_eq!(sel(Some(UUIDS[3])), vec![3]);
        assert_eq!(
            sel(Some(&UUIDS[2].to_uppercase().replace("MIG-", "mig-"))),
            vec![2]
        );
        assert_eq!(sel(Some(&format!("{},0", UUIDS[2]))), vec![2, 0]);
    }

    #[test]
    fn unique_prefixes_name_a_device_and_ambiguous_ones_do_not() {
        assert_eq!(sel(Some("GPU-56")), vec![3]);
        assert_eq!(sel(Some("GPU-3d2")), vec![0]);
        assert_eq!(sel(Some("GPU-3d")), Vec::<usize>::new());
        assert_eq!(sel(Some("MIG-4")), vec![2]);
        assert_eq!(sel(Some("GPU-")), Vec::<usize>::new());
    }

    #[test]
    fn the_first_bad_entry_ends_the_list() {
        assert_eq!(sel(Some("1,7,0")), vec![1]);
        assert_eq!(sel(Some("0,GPU-ffff,1")), vec![0]);
        assert_eq!(sel(Some("0,,1")), vec![0]);
        assert_eq!(sel(Some("-1,0")), Vec::<usize>::new());
        assert_eq!(sel(Some("0,0,1")), vec![0]);
        assert_eq!(sel(Some("3d2a07e5")), Vec::<usize>::new());
        assert_eq!(
            sel(Some("MIG-GPU-3d2a07e5-04b3-4312-87c3-c23be8aaee0f/1/0")),
            Vec::<usize>::new()
        );
    }
}
