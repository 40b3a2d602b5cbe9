use super::*;

#[test]
fn names_carry_the_prefix_and_units() {
    let m = Metrics::new();
    m.prepared(Duration::from_millis(20), true);
    m.prepared(Duration::from_millis(20), false);
    m.unprepared(Duration::from_millis(3), true);
    m.claim_read(Duration::from_millis(2));
    m.prepare_phase(Phase::Spec, Duration::from_micros(80));
    let text = m.render();
    for line in [
        "tessera_prepare_phase_duration_seconds_count{phase=\"spec\"} 1",
        "tessera_prepare_phase_duration_seconds_bucket{le=\"0.0001\",phase=\"spec\"} 1",
        "tessera_prepare_duration_seconds_count 2",
        "tessera_unprepare_duration_seconds_count 1",
        "tessera_claim_read_duration_seconds_count 1",
        "tessera_claim_operations_total{operation=\"prepare\",result=\"ok\"} 1",
        "tessera_claim_operations_total{operation=\"prepare\",result=\"error\"} 1",
        "tessera_claim_operations_total{operation=\"unprepare\",result=\"ok\"} 1",
        "tessera_prepared_claims 0",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
    }
    assert!(!m.ready());
}

#[test]
fn devices_and_gpus_are_counted_by_health() {
    use crate::health::{GpuHealth, XidPolicy};
    use std::time::SystemTime;
    use tessera_controller::model::DeviceRef;
    let device = |gpu: &str, kind| DeviceRef {
        gpu_uuid: gpu.into(),
        gpu_index: 0,
        kind,
    };
    let catalog = Catalog::new(
        Default::default(),
        [
            ("gpu-0".to_owned(), device("GPU-0", DeviceKind::Whole)),
            (
                "gpu-0-monitor".to_owned(),
                device("GPU-0", DeviceKind::Monitor),
            ),
            ("gpu-1".to_owned(), device("GPU-1", DeviceKind::Whole)),
            ("gpu-2".to_owned(), device("GPU-2", DeviceKind::Whole)),
        ]
        .into_iter()
        .collect(),
    );
    let at = SystemTime::UNIX_EPOCH;
    let map: HealthMap = [
        (
            "GPU-0".to_owned(),
            GpuHealth {
                health: Health::Unhealthy { xid: 79 },
                since: at,
                unhealthy_since: Some(at),
            },
        ),
        (
            "GPU-1".to_owned(),
            GpuHealth {
                health: Health::Healthy,
                since: at,
                unhealthy_since: None,
            },
        ),
    ]
    .into_iter()
    .collect();
    let tracker = HealthTracker::new(XidPolicy::default(), None);
    tracker.xid("GPU-0", Some(79), at);
    tracker.xid("GPU-0", Some(79), at);
    let m = Metrics::new();
    m.set_health(&map, Some(&catalog), &tracker.xid_counts());
    let text = m.render();
    for line in [
        "tessera_device_health{health=\"healthy\"} 1",
        "tessera_device_health{health=\"unhealthy\"} 2",
        "tessera_device_health{health=\"unknown\"} 1",
        "tessera_gpu_health{gpu=\"GPU-0\",health=\"unhealthy\"} 1",
        "tessera_gpu_health{gpu=\"GPU-1\",health=\"healthy\"} 1",
        "tessera_xid_errors_total{gpu=\"GPU-0\",xid=\"79\"} 2",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
    }
}

#[test]
fn gpu_and_claim_readings_render_with_their_units_and_only_what_nvml_gave() {
    let inventory = tessera_api::inventory::Inventory {
        gpus: vec![tessera_api::inventory::Gpu {
            uuid: "GPU-a".into(),
            product_name: "NVIDIA H100 80GB HBM3".into(),
            brand: "Nvidia".into(),
            architecture: "hopper".into(),
            cuda_compute_capability: "9.0".into(),
            pci_bus_id: "0000:07:00.0".into(),
            memory_bytes: 80 << 30,
            multiprocessors: 132,
            minor: 0,
            mig: tessera_api::inventory::Mig::NotSupported,
        }],
        ..Default::default()
    };
    let reading = gpus::GpuReading {
        uuid: "GPU-a".into(),
        utilization: Some(100),
        memory: Some((3 << 30, 80 << 30)),
        temperature_celsius: Some(72),
        power_milliwatts: None,
        migs: vec![
            ("MIG-1".into(), Some((1 << 30, 10 << 30))),
            ("MIG-2".into(), None),
        ],
        processes: Vec::new(),
        sm_percent: None,
    };
    let claim = claims::ClaimGpu {
        namespace: "ns".into(),
        name: "train".into(),
        gpu: "GPU-a".into(),
    };
    let uses = [(
        claim,
        claims::ClaimUse {
            memory_bytes: 3 << 30,
            sm_percent: Some(250),
        },
    )]
    .into_iter()
    .collect();
    let m = Metrics::new();
    m.set_gpus(&inventory, &[reading]);
    m.set_claims(&uses);
    let text = m.render();
    for line in [
        "tessera_gpu_info{gpu=\"GPU-a\",index=\"0\",model=\"NVIDIA H100 80GB HBM3\"} 1",
        "tessera_gpu_utilization_ratio{gpu=\"GPU-a\"} 1.0",
        "tessera_gpu_temperature_celsius{gpu=\"GPU-a\"} 72",
        "tessera_gpu_memory_used_bytes{gpu=\"GPU-a\"} 3221225472",
        "tessera_mig_memory_used_bytes{gpu=\"GPU-a\",mig=\"MIG-1\"} 1073741824",
        "tessera_claim_memory_used_bytes{namespace=\"ns\",claim=\"train\",gpu=\"GPU-a\"} 3221225472",
        // Several processes' samples never add up to more than the GPU.
        "tessera_claim_sm_utilization_ratio{namespace=\"ns\",claim=\"train\",gpu=\"GPU-a\"} 1.0",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
    }
    for absent in ["tessera_gpu_power_watts{", "mig=\"MIG-2\""] {
        assert!(!text.contains(absent), "{absent} in\n{text}");
    }
    // The claim unprepared: its series go.
    m.set_claims(&Default::default());
    assert!(!m.render().contains("claim=\"train\""));
}

#[test]
fn a_counter_catches_up_with_a_running_total() {
    let c = Counter::<u64>::default();
    catch_up(&c, 3);
    catch_up(&c, 3);
    catch_up(&c, 5);
    assert_eq!(c.get(), 5);
}

#[tokio::test]
async fn a_render_that_panics_answers_why_with_the_same_text() {
    struct Panics;
    impl Sample for Panics {
        fn sample(&self, _: &Metrics) {
            panic!("the sampler broke");
        }
    }
    let metrics = Arc::new(Metrics::new());
    metrics.set_sampler(Panics);
    let err = (metrics.scrape(Duration::from_secs(10)).await)
        .expect("answered in time")
        .unwrap_err();
    assert_eq!(err, renders::RenderError::Panicked);
    assert_eq!(
        err.to_string(),
        "sampling the metrics panicked (see the log)"
    );
}
