use super::*;

#[test]
fn mps_server_reserve_is_bounded_and_named_when_wrong() {
    let ok = NodePolicy::from_yaml(
        "gpus:\n- select: {all: true}\n  mpsServerReserveMiB: 0\n- select: {index: 1}\n  mpsServerReserveMiB: 8192\n",
    )
    .unwrap();
    assert_eq!(ok.gpus[1].mps_server_reserve_mib, Some(8192));
    let err = NodePolicy::from_yaml(
        "gpus:\n- select: {all: true}\n- select: {index: 1}\n  mpsServerReserveMiB: 8193\n",
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "node policy: gpus[1].mpsServerReserveMiB: must be at most 8192 (MiB of GPU memory \
         per MPS server), not 8193"
    );
    let err = NodePolicy::from_yaml("gpus:\n- select: {all: true}\n  mpsServerReserveMiB: -1\n")
        .unwrap_err();
    assert!(err.to_string().contains("mpsServerReserveMiB"), "{err}");
    assert_eq!(
        GpuPolicy::default().mps_server_reserve_bytes,
        DEFAULT_MPS_SERVER_RESERVE_MIB << 20
    );
}

#[test]
fn glob() {
    assert!(glob_match("*", "1g.10gb"));
    assert!(glob_match("1g.*", "1g.10gb+me"));
    assert!(!glob_match("1g.*", "2g.20gb"));
    assert!(glob_match("?g.40gb", "3g.40gb"));
    assert!(glob_match("nvidia h100*", "nvidia h100 80gb hbm3"));
    assert!(!glob_match("nvidia a100", "nvidia a100-sxm4-40gb"));
    assert!(glob_match("*a100*40gb", "nvidia a100-sxm4-40gb"));
    assert!(glob_match("", ""));
    assert!(!glob_match("", "x"));
}
