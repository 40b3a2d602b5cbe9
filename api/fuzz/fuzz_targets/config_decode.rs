//! Arbitrary bytes into the opaque config decoder, and whatever decodes on
//! into precedence resolution against every device type. The property is
//! simply "never panics, never hangs": every input gets an `Ok` or a
//! [`Problem`](tessera_api::config::Problem).

#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_api::config::{
    ConfigSource, DeviceTarget, DeviceType, Holdings, IsolationLevel, Origin, decode,
    resolve_claim,
};

fuzz_target!(|data: &[u8]| {
    let Ok(_) = decode(data) else { return };
    // Decodable: it is valid JSON, so resolve it as a claim config too.
    let parameters: serde_json::Value = serde_json::from_slice(data).expect("decoded above");
    let sources = [ConfigSource {
        origin: Origin::Claim,
        requests: vec!["r".into()],
        index: 0,
        parameters,
    }];
    for device_type in [
        DeviceType::Gpu,
        DeviceType::Mig,
        DeviceType::Share(IsolationLevel::Isolated),
        DeviceType::Share(IsolationLevel::Shared),
    ] {
        let device = DeviceTarget {
            request: "r".into(),
            device: "d".into(),
            device_type,
            holds: Holdings {
                memory_bytes: 8 << 30,
                compute_percent: 50,
            },
        };
        let _ = resolve_claim("fuzz/claim", &sources, &[device]);
    }
});
