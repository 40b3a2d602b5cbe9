//! Where MIG instances may go: the compute instance profiles, the sizes a
//! GPU instance splits into and the slices each may start at.

/// `NVML_COMPUTE_INSTANCE_PROFILE_*` for a compute instance of `slices` slices.
pub fn compute_profile_id(slices: u32) -> Option<u32> {
    Some(match slices {
        1 => 0,
        2 => 1,
        3 => 2,
        4 => 3,
        7 => 4,
        8 => 5,
        6 => 6,
        _ => return None,
    })
}

/// Compute slices per compute instance profile id (inverse of [`compute_profile_id`]).
pub fn compute_profile_slices(id: u32) -> Option<u32> {
    Some(match id {
        0 => 1,
        1 => 2,
        2 => 3,
        3 => 4,
        4 => 7,
        5 => 8,
        6 => 6,
        _ => return None,
    })
}

/// Compute instance sizes a GPU instance of `slices` slices can be split into.
pub fn compute_instance_sizes(slices: u32) -> &'static [u32] {
    match slices {
        1 => &[1],
        2 => &[1, 2],
        3 => &[1, 2, 3],
        4 => &[1, 2, 4],
        6 => &[1, 2, 3, 6],
        7 => &[1, 2, 3, 4, 7],
        8 => &[1, 2, 4, 8],
        _ => &[],
    }
}

/// Compute-slice starts for a compute instance of `slices` in a GPU instance of `gi_slices`.
pub fn compute_placements(gi_slices: u32, slices: u32) -> Vec<u32> {
    if slices == 0 || !compute_instance_sizes(gi_slices).contains(&slices) {
        return Vec::new();
    }
    (0..gi_slices)
        .step_by(slices as usize)
        .filter(|s| s + slices <= gi_slices)
        .collect()
}

/// Whether two `(start, size)` ranges share a slice.
pub fn overlaps(a: (u32, u32), b: (u32, u32)) -> bool {
    a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}
