use super::*;

fn key(request: &str, device: &str) -> DaemonKey {
    DaemonKey {
        claim: ClaimUid::parse("00000000-0000-4000-8000-000000000001").unwrap(),
        request: request.into(),
        device: device.into(),
    }
}

#[test]
fn tags_are_short_stable_and_keep_requests_and_devices_apart() {
    let a = key("gpu", "GPU-a");
    assert_eq!(a.tag().len(), 8);
    assert_eq!(a.tag(), key("gpu", "GPU-a").tag());
    assert_ne!(a.tag(), key("gpu", "GPU-b").tag());
    assert_ne!(a.tag(), key("gpu2", "GPU-a").tag());
    // The separator keeps "ab"+"c" apart from "a"+"bc".
    assert_ne!(key("ab", "c").tag(), key("a", "bc").tag());
}
