//! The opaque handles NVML hands out: tagged integers, never pointers, so
//! a stale or forged one is answered with INVALID_ARGUMENT instead of
//! touching freed memory.

/// What a device handle refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceRef {
    Gpu(usize),
    /// A MIG device: compute instance `ci` of GPU instance `gi` on `gpu`.
    Mig {
        gpu: usize,
        gi: u32,
        ci: u32,
    },
}

impl DeviceRef {
    pub fn gpu(self) -> usize {
        match self {
            DeviceRef::Gpu(g) | DeviceRef::Mig { gpu: g, .. } => g,
        }
    }
}

/// Kinds of handle, in bits 44..48 of the handle value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub enum Kind {
    Device = 1,
    GpuInstance = 2,
    ComputeInstance = 3,
    EventSet = 4,
}

const MAGIC: u64 = 0x7E55 << 48;
const FIELD: u64 = (1 << 14) - 1;

/// Packs a handle value: `MAGIC | kind | gpu | gi+1 | ci+1`; 0 in the gi/ci
/// fields means "not given".
pub fn encode(kind: Kind, gpu: usize, gi: Option<u32>, ci: Option<u32>) -> usize {
    let field = |v: Option<u32>| v.map_or(0, |v| (u64::from(v) + 1) & FIELD);
    let value =
        MAGIC | (kind as u64) << 44 | ((gpu as u64) & 0xFFFF) << 28 | field(gi) << 14 | field(ci);
    value as usize
}

/// Unpacks a handle value made by [`encode`] for `kind`.
pub fn decode(kind: Kind, value: usize) -> Option<(usize, Option<u32>, Option<u32>)> {
    let value = value as u64;
    if value & (0xFFFF << 48) != MAGIC || (value >> 44) & 0xF != kind as u64 {
        return None;
    }
    let field = |v: u64| (v != 0).then(|| (v - 1) as u32);
    Some((
        ((value >> 28) & 0xFFFF) as usize,
        field((value >> 14) & FIELD),
        field(value & FIELD),
    ))
}
