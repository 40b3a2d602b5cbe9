//! Errors: the names and texts of `CUresult` codes.

use std::ffi::c_char;
use std::ptr;

use crate::codes::{self, *};
use crate::{ffi, put};

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(error: CUresult, text: *mut *const c_char) -> CUresult {
    error_text(error, text, codes::name)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(error: CUresult, text: *mut *const c_char) -> CUresult {
    error_text(error, text, codes::description)
}

fn error_text(
    error: CUresult,
    text: *mut *const c_char,
    lookup: fn(CUresult) -> Option<*const c_char>,
) -> CUresult {
    ffi(|| {
        // Works before cuInit, as CUDA's does. An unknown code: NULL and
        // INVALID_VALUE.
        let found = lookup(error);
        // SAFETY: CUDA contract: null or valid for a pointer.
        unsafe { put(text, found.unwrap_or(ptr::null())) }?;
        found.map(|_| ()).ok_or(INVALID_VALUE)
    })
}
