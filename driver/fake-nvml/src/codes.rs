//! NVML return codes: names (for topology files) and the text
//! `nvmlErrorString` gives.

use std::ffi::c_char;

use nvml_wrapper_sys::bindings::*;

pub type Ret = nvmlReturn_t;

pub const SUCCESS: Ret = nvmlReturn_enum_NVML_SUCCESS;
pub const UNINITIALIZED: Ret = nvmlReturn_enum_NVML_ERROR_UNINITIALIZED;
pub const INVALID_ARGUMENT: Ret = nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
pub const NOT_SUPPORTED: Ret = nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
pub const NOT_FOUND: Ret = nvmlReturn_enum_NVML_ERROR_NOT_FOUND;
pub const INSUFFICIENT_SIZE: Ret = nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE;
pub const TIMEOUT: Ret = nvmlReturn_enum_NVML_ERROR_TIMEOUT;
pub const GPU_IS_LOST: Ret = nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST;
pub const IN_USE: Ret = nvmlReturn_enum_NVML_ERROR_IN_USE;
pub const INSUFFICIENT_RESOURCES: Ret = nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES;
pub const ARGUMENT_VERSION_MISMATCH: Ret = nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
pub const NO_PERMISSION: Ret = nvmlReturn_enum_NVML_ERROR_NO_PERMISSION;
pub const UNKNOWN: Ret = nvmlReturn_enum_NVML_ERROR_UNKNOWN;

/// Every code with its name (without the `NVML_ERROR_` prefix) and message.
const TABLE: &[(Ret, &str, &[u8])] = &[
    (SUCCESS, "SUCCESS", b"Success\0"),
    (UNINITIALIZED, "UNINITIALIZED", b"Uninitialized\0"),
    (INVALID_ARGUMENT, "INVALID_ARGUMENT", b"Invalid Argument\0"),
    (NOT_SUPPORTED, "NOT_SUPPORTED", b"Not Supported\0"),
    (
        nvmlReturn_enum_NVML_ERROR_NO_PERMISSION,
        "NO_PERMISSION",
        b"Insufficient Permissions\0",
    ),
    (
        nvmlReturn_enum_NVML_ERROR_ALREADY_INITIALIZED,
        "ALREADY_INITIALIZED",
        b"Already Initialized\0",
    ),
    (NOT_FOUND, "NOT_FOUND", b"Not Found\0"),
    (
        INSUFFICIENT_SIZE,
        "INSUFFICIENT_SIZE",
        b"Insufficient Size\0",
    ),
    (
        nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_POWER,
        "INSUFFICIENT_POWER",
        b"Insufficient External Power\0",
    ),
    (
        nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED,
        "DRIVER_NOT_LOADED",
        b"Driver Not Loaded\0",
    ),
    (TIMEOUT, "TIMEOUT", b"Timeout\0"),
    (
        nvmlReturn_enum_NVML_ERROR_IRQ_ISSUE,
        "IRQ_ISSUE",
        b"Interrupt Request Issue\0",
    ),
    (
        nvmlReturn_enum_NVML_ERROR_LIBRARY_NOT_FOUND,
        "LIBRARY_NOT_FOUND",
        b"NVML Shared Library Not Found\0",
    ),
    (
        nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND,
        "FUNCTION_NOT_FOUND",
        b"Function Not Found\0",
    ),
    (
        nvmlReturn_enum_NVML_ERROR_CORRUPTED_INFOROM,
        "CORRUPTED_INFOROM",
        b"Corrupted infoROM\0",
    ),
    (GPU_IS_LOST, "GPU_IS_LOST", b"GPU is lost\0"),
    (
        nvmlReturn_enum_NVML_ERROR_RESET_REQUIRED,
        "RESET_REQUIRED",
        b"GPU requires restart\0",
    ),
    (
        nvmlReturn_enum_NVML_ERROR_OPERATING_SYSTEM,
        "OPERATING_SYSTEM",
        b"The operating system has blocked the request.\0",
    ),
    (
        nvmlReturn_enum_NVML_ERROR_LIB_RM_VERSION_MISMATCH,
        "LIB_RM_VERSION_MISMATCH",
        b"RM has detected an NVML/RM version mismatch.\0",
    ),
    (IN_USE, "IN_USE", b"In use by another client\0"),
    (
        nvmlReturn_enum_NVML_ERROR_MEMORY,
        "MEMORY",
        b"Insufficient Memory\0",
    ),
    (nvmlReturn_enum_NVML_ERROR_NO_DATA, "NO_DATA", b"No data\0"),
    (
        INSUFFICIENT_RESOURCES,
        "INSUFFICIENT_RESOURCES",
        b"Insufficient resources\0",
    ),
    (
        ARGUMENT_VERSION_MISMATCH,
        "ARGUMENT_VERSION_MISMATCH",
        b"Version mismatch\0",
    ),
    (
        nvmlReturn_enum_NVML_ERROR_NOT_READY,
        "NOT_READY",
        b"System is not ready\0",
    ),
    (
        nvmlReturn_enum_NVML_ERROR_GPU_NOT_FOUND,
        "GPU_NOT_FOUND",
        b"GPU not found\0",
    ),
    (
        nvmlReturn_enum_NVML_ERROR_INVALID_STATE,
        "INVALID_STATE",
        b"Invalid state\0",
    ),
    (UNKNOWN, "UNKNOWN", b"Unknown Error\0"),
];

/// A return code by name, with or without the `NVML_ERROR_` prefix.
pub fn by_name(name: &str) -> Option<Ret> {
    let name = name.trim();
    let short = name
        .strip_prefix("NVML_ERROR_")
        .or_else(|| name.strip_prefix("NVML_"))
        .unwrap_or(name);
    TABLE
        .iter()
        .find(|(_, n, _)| n.eq_ignore_ascii_case(short))
        .map(|(code, _, _)| *code)
}

/// Static NUL-terminated message for a code.
pub fn message(code: Ret) -> *const c_char {
    let text: &'static [u8] = TABLE
        .iter()
        .find(|(c, _, _)| *c == code)
        .map(|(_, _, m)| *m)
        .unwrap_or(b"Unknown Error\0");
    text.as_ptr().cast()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_resolve_with_and_without_prefix() {
        assert_eq!(by_name("DRIVER_NOT_LOADED"), Some(9));
        assert_eq!(by_name("NVML_ERROR_GPU_IS_LOST"), Some(GPU_IS_LOST));
        assert_eq!(by_name("no_permission"), Some(4));
        assert_eq!(by_name("BOGUS"), None);
    }

    #[test]
    fn every_message_is_nul_terminated() {
        for (_, _, m) in TABLE {
            assert_eq!(m.last(), Some(&0));
            assert_eq!(m.iter().filter(|b| **b == 0).count(), 1);
        }
    }
}
