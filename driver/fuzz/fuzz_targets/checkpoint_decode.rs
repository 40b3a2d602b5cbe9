//! Arbitrary bytes into the checkpoint reader: the envelope (version,
//! boot id, checksum) with generic entries, and with the entries the
//! plugin really stores (claim UIDs validated, states, actions, CDI specs).
//! The property is "never panics, never hangs": a corrupted checkpoint must
//! be quarantined, not crash the node daemon at every start.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tessera_driver::state::checkpoint::fuzz_decode(data);
    tessera_driver::prepare::fuzz_decode_checkpoint(data);
});
