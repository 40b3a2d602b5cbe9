use super::*;

#[test]
fn gpu_instance_ids_follow_the_slice_tree() {
    assert_eq!(default_gpu_instance_id(8, 0, 8), 0);
    assert_eq!(default_gpu_instance_id(8, 4, 4), 1);
    assert_eq!(default_gpu_instance_id(8, 0, 4), 2);
    assert_eq!(default_gpu_instance_id(8, 4, 2), 3);
    assert_eq!(default_gpu_instance_id(8, 2, 2), 6);
    assert_eq!(default_gpu_instance_id(8, 4, 1), 7);
    assert_eq!(default_gpu_instance_id(8, 0, 1), 11);
    assert_eq!(default_gpu_instance_id(8, 1, 1), 12);
    assert_eq!(default_gpu_instance_id(8, 3, 1), 14);
}

#[test]
fn pci_addresses_parse_both_forms() {
    let a = PciAddress::parse("00000000:1b:00.0").unwrap();
    assert_eq!(a, PciAddress::parse("0000:1B:00.0").unwrap());
    assert_eq!(a.nvml(), "00000000:1B:00.0");
    assert_eq!(a.legacy(), "0000:1B:00.0");
    assert!(PciAddress::parse("1b:00.0").is_none());
    assert!(PciAddress::parse("0000:1b:00").is_none());
    assert!(PciAddress::parse("0000:zz:00.0").is_none());
}
