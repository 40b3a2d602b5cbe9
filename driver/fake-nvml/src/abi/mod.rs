//! The exported NVML C ABI, one file per part of the API.
//!
//! Every function here is `#[no_mangle] extern "C"` under NVML's name (or,
//! for the simulation's own controls, a `tesseraFake` name); the crate root
//! re-exports them so in-process callers find them where the cdylib's
//! symbols are.

mod activity;
mod compute_instances;
mod device;
mod events;
mod gpu_instances;
mod handles;
mod init;
mod mig_mode;

pub use activity::*;
pub use compute_instances::*;
pub use device::*;
pub use events::*;
pub use gpu_instances::*;
pub use handles::*;
pub use init::*;
pub use mig_mode::*;
