//! Handles, placements and made-up UUIDs, each checked on its own.

use super::handles::{Kind, decode, encode};
use super::mig_uuid;
use super::placements::compute_placements;

#[test]
fn handles_round_trip_and_reject_other_kinds() {
    let h = encode(Kind::Device, 3, Some(9), Some(0));
    assert_eq!(decode(Kind::Device, h), Some((3, Some(9), Some(0))));
    assert_eq!(decode(Kind::GpuInstance, h), None);
    assert_eq!(decode(Kind::Device, 0), None);
    assert_eq!(decode(Kind::Device, 0x1234), None);
    let g = encode(Kind::Device, 0, None, None);
    assert_eq!(decode(Kind::Device, g), Some((0, None, None)));
}

#[test]
fn compute_placements_tile_the_gpu_instance() {
    assert_eq!(compute_placements(3, 1), vec![0, 1, 2]);
    assert_eq!(compute_placements(4, 2), vec![0, 2]);
    assert_eq!(compute_placements(7, 7), vec![0]);
    assert!(compute_placements(4, 3).is_empty());
}

#[test]
fn created_uuids_are_well_formed_and_distinct() {
    let a = mig_uuid("GPU-1", 1, 1);
    let b = mig_uuid("GPU-1", 1, 2);
    assert_ne!(a, b);
    assert_eq!(a.len(), "MIG-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx".len());
}
