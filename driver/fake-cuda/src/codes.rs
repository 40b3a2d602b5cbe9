//! `CUresult` values (the numbers of NVIDIA's `cuda.h`), their names for
//! `cuGetErrorName` and short descriptions for `cuGetErrorString`.

use std::ffi::{c_char, c_int};

/// `CUresult`: an `enum` in `cuda.h`, an `int` in the ABI.
pub type CUresult = c_int;

pub const SUCCESS: CUresult = 0;
pub const INVALID_VALUE: CUresult = 1;
pub const OUT_OF_MEMORY: CUresult = 2;
pub const NOT_INITIALIZED: CUresult = 3;
pub const DEVICE_UNAVAILABLE: CUresult = 46;
pub const NO_DEVICE: CUresult = 100;
pub const INVALID_DEVICE: CUresult = 101;
pub const INVALID_IMAGE: CUresult = 200;
pub const INVALID_CONTEXT: CUresult = 201;
pub const INVALID_HANDLE: CUresult = 400;
pub const NOT_FOUND: CUresult = 500;
pub const MPS_CONNECTION_FAILED: CUresult = 805;
pub const UNKNOWN: CUresult = 999;

/// Every code this library knows: value, name, description (NUL-terminated,
/// handed out as C strings).
const TABLE: &[(CUresult, &[u8], &[u8])] = &[
    (SUCCESS, b"CUDA_SUCCESS\0", b"no error\0"),
    (
        INVALID_VALUE,
        b"CUDA_ERROR_INVALID_VALUE\0",
        b"invalid argument\0",
    ),
    (
        OUT_OF_MEMORY,
        b"CUDA_ERROR_OUT_OF_MEMORY\0",
        b"out of memory\0",
    ),
    (
        NOT_INITIALIZED,
        b"CUDA_ERROR_NOT_INITIALIZED\0",
        b"initialization error\0",
    ),
    (4, b"CUDA_ERROR_DEINITIALIZED\0", b"driver shutting down\0"),
    (
        34,
        b"CUDA_ERROR_STUB_LIBRARY\0",
        b"CUDA driver is a stub library\0",
    ),
    (
        DEVICE_UNAVAILABLE,
        b"CUDA_ERROR_DEVICE_UNAVAILABLE\0",
        b"CUDA-capable device(s) is/are busy or unavailable\0",
    ),
    (
        NO_DEVICE,
        b"CUDA_ERROR_NO_DEVICE\0",
        b"no CUDA-capable device is detected\0",
    ),
    (
        INVALID_DEVICE,
        b"CUDA_ERROR_INVALID_DEVICE\0",
        b"invalid device ordinal\0",
    ),
    (
        INVALID_IMAGE,
        b"CUDA_ERROR_INVALID_IMAGE\0",
        b"device kernel image is invalid\0",
    ),
    (
        INVALID_CONTEXT,
        b"CUDA_ERROR_INVALID_CONTEXT\0",
        b"invalid device context\0",
    ),
    (
        202,
        b"CUDA_ERROR_CONTEXT_ALREADY_CURRENT\0",
        b"context already current\0",
    ),
    (
        INVALID_HANDLE,
        b"CUDA_ERROR_INVALID_HANDLE\0",
        b"invalid resource handle\0",
    ),
    (
        NOT_FOUND,
        b"CUDA_ERROR_NOT_FOUND\0",
        b"named symbol not found\0",
    ),
    (
        708,
        b"CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE\0",
        b"primary context active\0",
    ),
    (
        709,
        b"CUDA_ERROR_CONTEXT_IS_DESTROYED\0",
        b"context is destroyed\0",
    ),
    (
        801,
        b"CUDA_ERROR_NOT_SUPPORTED\0",
        b"operation not supported\0",
    ),
    (
        MPS_CONNECTION_FAILED,
        b"CUDA_ERROR_MPS_CONNECTION_FAILED\0",
        b"MPS client failed to connect to the MPS control daemon or the MPS server\0",
    ),
    (
        806,
        b"CUDA_ERROR_MPS_RPC_FAILURE\0",
        b"MPS remote procedure call failed\0",
    ),
    (
        807,
        b"CUDA_ERROR_MPS_SERVER_NOT_READY\0",
        b"MPS server is not ready to accept new clients\0",
    ),
    (UNKNOWN, b"CUDA_ERROR_UNKNOWN\0", b"unknown error\0"),
];

fn entry(code: CUresult) -> Option<&'static (CUresult, &'static [u8], &'static [u8])> {
    TABLE.iter().find(|(c, _, _)| *c == code)
}

/// `CUDA_ERROR_...` for `code`, as a C string; `None` for codes this
/// library does not know.
pub fn name(code: CUresult) -> Option<*const c_char> {
    entry(code).map(|(_, n, _)| n.as_ptr().cast())
}

/// The description of `code`, as a C string.
pub fn description(code: CUresult) -> Option<*const c_char> {
    entry(code).map(|(_, _, d)| d.as_ptr().cast())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_is_nul_terminated_and_unique() {
        for (i, (code, name, desc)) in TABLE.iter().enumerate() {
            assert_eq!(name.last(), Some(&0));
            assert_eq!(desc.last(), Some(&0));
            assert!(!name[..name.len() - 1].contains(&0));
            assert!(name.starts_with(b"CUDA_"));
            assert!(TABLE[i + 1..].iter().all(|(c, _, _)| c != code));
        }
        assert!(name(12345).is_none());
    }
}
