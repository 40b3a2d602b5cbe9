use serde_json::{Value, json};

use super::*;

const GI: u64 = 1 << 30;

fn v(kind: &str, body: Value) -> Value {
    let mut object = json!({ "apiVersion": API_VERSION, "kind": kind });
    if let (Value::Object(o), Value::Object(b)) = (&mut object, body) {
        o.extend(b);
    }
    object
}

fn problem(value: Value) -> Problem {
    decode_value(&value).expect_err("should not decode")
}

fn source(origin: Origin, requests: &[&str], index: usize, parameters: Value) -> ConfigSource {
    ConfigSource {
        origin,
        requests: requests.iter().map(|r| r.to_string()).collect(),
        index,
        parameters,
    }
}

fn gpu(request: &str) -> DeviceTarget {
    DeviceTarget {
        request: request.into(),
        device: "gpu-0".into(),
        device_type: DeviceType::Gpu,
        holds: Holdings {
            memory_bytes: 80 * GI,
            compute_percent: 100,
        },
    }
}

fn mig(request: &str) -> DeviceTarget {
    DeviceTarget {
        request: request.into(),
        device: "gpu-0-mig-1g10gb-0".into(),
        device_type: DeviceType::Mig,
        holds: Holdings {
            memory_bytes: 10 * GI,
            compute_percent: 100,
        },
    }
}

fn share(request: &str, level: IsolationLevel, memory_gi: u64, cores: u32) -> DeviceTarget {
    DeviceTarget {
        request: request.into(),
        device: "gpu-0-share".into(),
        device_type: DeviceType::Share(level),
        holds: Holdings {
            memory_bytes: memory_gi * GI,
            compute_percent: cores,
        },
    }
}

fn time_slicing(interval: &str) -> Value {
    v(
        "GpuConfig",
        json!({"sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": interval}}}),
    )
}

fn interval_of(config: &EffectiveConfig) -> TimeSliceInterval {
    match config {
        EffectiveConfig::Gpu {
            sharing: Sharing::TimeSlicing { interval },
        } => *interval,
        other => panic!("not time-slicing: {other:?}"),
    }
}

fn resolve_one(
    sources: &[ConfigSource],
    device: DeviceTarget,
) -> Result<EffectiveConfig, ConfigError> {
    resolve_claim("team/train", sources, &[device]).map(|mut v| v.remove(0))
}

// ---- decoding ---------------------------------------------------------

#[test]
fn decodes_every_kind() {
    let c = decode(
        br#"{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig",
             "sharing":{"strategy":"MPS","mps":{"memory":"20Gi","computePercent":50}}}"#,
    )
    .unwrap();
    let Config::Gpu(g) = c else { panic!() };
    let sharing = g.sharing.unwrap();
    assert_eq!(sharing.strategy, Some(GpuSharingStrategy::Mps));
    let mps = sharing.mps.unwrap();
    assert_eq!(mps.memory, Some(Quantity::from_bytes(20 * GI)));
    assert_eq!(mps.compute_percent, Some(50));

    let c = decode_value(&v("MigConfig", json!({"sharing": {"strategy": "None"}}))).unwrap();
    assert_eq!(c.kind(), Kind::MigConfig);

    let c = decode_value(&v(
        "ShareConfig",
        json!({"processLimits": {"memory": 1048576}}),
    ))
    .unwrap();
    let Config::Share(s) = c else { panic!() };
    assert_eq!(s.process_limits.unwrap().memory.unwrap().bytes(), 1 << 20);

    // Only apiVersion and kind: a valid config that changes nothing.
    assert_eq!(
        decode_value(&v("GpuConfig", json!({}))).unwrap(),
        Config::Gpu(GpuConfig::default())
    );
}

#[test]
fn quantities() {
    let ok = [
        ("1", 1),
        ("4Gi", 4 * GI),
        ("512Mi", 512 << 20),
        ("1.5Gi", 3 * GI / 2),
        ("8G", 8_000_000_000),
        ("2k", 2_000),
        ("1Ei", 1 << 60),
        ("0.5", 1), // fractions of a byte round up
        ("15Ei", 15 << 60),
    ];
    for (text, bytes) in ok {
        assert_eq!(
            Quantity::parse(text),
            Ok(Quantity::from_bytes(bytes)),
            "{text}"
        );
    }
    for bad in [
        "",
        "Gi",
        "4GB",
        "4 Gi",
        "-1",
        "1e9",
        "1.",
        ".5",
        "1.2.3",
        "4gi",
        "500m",
        "16Ei",
        "99999999999999999999999",
    ] {
        assert!(Quantity::parse(bad).is_err(), "{bad:?} should not parse");
    }
    assert_eq!(Quantity::from_bytes(4 * GI).to_string(), "4Gi");
    assert_eq!(Quantity::from_bytes(1536 << 20).to_string(), "1536Mi");
    assert_eq!(Quantity::from_bytes(1000).to_string(), "1000");
}

#[test]
fn strict_decoding_names_the_field() {
    let p = problem(v("GpuConfig", json!({"shareing": {}})));
    assert_eq!(p.kind, ProblemKind::UnknownField);
    assert_eq!(p.field, "shareing");
    assert!(p.message.contains("sharing"), "{p}");

    let p = problem(v(
        "GpuConfig",
        json!({"sharing": {"strategy": "TimeSlicing", "timeSlicing": {"intreval": "Long"}}}),
    ));
    assert_eq!(p.kind, ProblemKind::UnknownField);
    assert_eq!(p.field, "sharing.timeSlicing.intreval");
    assert!(
        p.to_string()
            .contains("fix: remove it or correct its spelling"),
        "{p}"
    );

    let p = problem(v(
        "ShareConfig",
        json!({"processLimits": {"memory": "4Gi", "cores": 10}}),
    ));
    assert_eq!(p.field, "processLimits.cores");

    // Enum values are case-sensitive.
    let p = problem(time_slicing("long"));
    assert_eq!(p.kind, ProblemKind::InvalidValue);
    assert_eq!(p.field, "sharing.timeSlicing.interval");
    assert!(p.message.contains("Long"), "lists the allowed values: {p}");

    // Wrong types.
    let p = problem(v(
        "ShareConfig",
        json!({"processLimits": {"computePercent": "50"}}),
    ));
    assert_eq!(p.field, "processLimits.computePercent");
    let p = problem(v(
        "ShareConfig",
        json!({"processLimits": {"memory": "4GB"}}),
    ));
    assert_eq!(p.field, "processLimits.memory");
    assert!(p.fix.contains("4Gi"), "{p}");
    let p = problem(v("ShareConfig", json!({"processLimits": {"memory": -4}})));
    assert_eq!(p.field, "processLimits.memory");
    let p = problem(v("GpuConfig", json!({"sharing": "MPS"})));
    assert_eq!(p.field, "sharing");
    assert!(!p.message.contains("struct"), "no Rust type names: {p}");
    assert!(p.fix.contains("strategy: MPS"), "{p}");

    // MIG has no time-slicing; the fix says why.
    let p = problem(v(
        "MigConfig",
        json!({"sharing": {"strategy": "TimeSlicing"}}),
    ));
    assert_eq!(p.field, "sharing.strategy");
    assert!(p.fix.contains("parent GPU"), "{p}");
}

#[test]
fn header_errors() {
    let p = problem(json!({"kind": "GpuConfig"}));
    assert_eq!(
        (p.kind, p.field.as_str()),
        (ProblemKind::MissingField, "apiVersion")
    );
    assert!(p.fix.contains(API_VERSION));

    let p = problem(json!({"apiVersion": API_VERSION}));
    assert_eq!(
        (p.kind, p.field.as_str()),
        (ProblemKind::MissingField, "kind")
    );

    let p = problem(json!({"apiVersion": "gpu.tessera.dev/v1", "kind": "GpuConfig"}));
    assert_eq!(p.kind, ProblemKind::UnsupportedApiVersion);
    assert!(p.message.contains("v1"), "{p}");

    let p = problem(json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}));
    assert_eq!(p.kind, ProblemKind::UnsupportedApiVersion);
    assert!(p.fix.contains("opaque.driver"), "{p}");

    let p = problem(json!({"apiVersion": API_VERSION, "kind": "GpuSharing"}));
    assert_eq!(
        (p.kind, p.field.as_str()),
        (ProblemKind::UnknownKind, "kind")
    );
    assert!(p.fix.contains("GpuConfig, MigConfig, ShareConfig"));

    let p = problem(json!({"apiVersion": API_VERSION, "kind": 3}));
    assert_eq!(
        (p.kind, p.field.as_str()),
        (ProblemKind::InvalidValue, "kind")
    );

    let p = problem(json!(["GpuConfig"]));
    assert_eq!(
        (p.kind, p.field.as_str()),
        (ProblemKind::Malformed, "parameters")
    );

    let p = decode(b"{\"apiVersion\":").unwrap_err();
    assert_eq!(p.kind, ProblemKind::Malformed);

    let big = vec![b' '; MAX_PARAMETERS_BYTES + 1];
    assert_eq!(decode(&big).unwrap_err().kind, ProblemKind::Malformed);
}

#[test]
fn self_consistency_checks() {
    // A strategy's block needs the strategy stated next to it.
    let p = problem(v(
        "GpuConfig",
        json!({"sharing": {"timeSlicing": {"interval": "Long"}}}),
    ));
    assert_eq!(p.field, "sharing.timeSlicing");
    assert!(p.fix.contains("strategy: TimeSlicing"), "{p}");
    let p = problem(v(
        "GpuConfig",
        json!({"sharing": {"strategy": "TimeSlicing", "mps": {"computePercent": 10}}}),
    ));
    assert_eq!(p.field, "sharing.mps");
    let p = problem(v("MigConfig", json!({"sharing": {"mps": {}}})));
    assert_eq!(p.field, "sharing.mps");

    for bad in [0, 101] {
        let p = problem(v(
            "ShareConfig",
            json!({"processLimits": {"computePercent": bad}}),
        ));
        assert_eq!(p.field, "processLimits.computePercent");
    }
    let p = problem(v(
        "ShareConfig",
        json!({"processLimits": {"memory": "0Gi"}}),
    ));
    assert_eq!(p.field, "processLimits.memory");
}

// ---- defaults and precedence -------------------------------------------

#[test]
fn defaults_without_configs() {
    let devices = [
        gpu("a"),
        mig("b"),
        share("c", IsolationLevel::Isolated, 10, 25),
        share("d", IsolationLevel::Shared, 10, 25),
    ];
    let got = resolve_claim("team/train", &[], &devices).unwrap();
    assert_eq!(
        got,
        [
            EffectiveConfig::Gpu {
                sharing: Sharing::None
            },
            EffectiveConfig::Mig {
                sharing: Sharing::None
            },
            EffectiveConfig::Share {
                limits: Some(Limits {
                    memory_bytes: 10 * GI,
                    compute_percent: 25,
                    shared_memory_bytes: None
                })
            },
            EffectiveConfig::Share { limits: None },
        ]
    );
    for (d, g) in devices.iter().zip(&got) {
        assert_eq!(&EffectiveConfig::defaults_for(d), g);
    }

    // TimeSlicing without an interval gets the driver's default slice; MPS
    // without limits gets the whole device.
    let ts = v("GpuConfig", json!({"sharing": {"strategy": "TimeSlicing"}}));
    let got = resolve_one(&[source(Origin::Claim, &[], 0, ts)], gpu("a")).unwrap();
    assert_eq!(interval_of(&got), TimeSliceInterval::Default);
    let mps = v("MigConfig", json!({"sharing": {"strategy": "MPS"}}));
    let got = resolve_one(&[source(Origin::Claim, &[], 0, mps)], mig("a")).unwrap();
    assert_eq!(
        got,
        EffectiveConfig::Mig {
            sharing: Sharing::Mps {
                limits: Limits {
                    memory_bytes: 10 * GI,
                    compute_percent: 100,
                    shared_memory_bytes: None
                }
            }
        }
    );
}

#[test]
fn claim_beats_class() {
    // Claim configs win even when the class config comes later in the list
    // and is scoped while the claim's is not.
    let sources = [
        source(Origin::Claim, &[], 0, time_slicing("Short")),
        source(Origin::Class, &["a"], 1, time_slicing("Long")),
    ];
    assert_eq!(
        interval_of(&resolve_one(&sources, gpu("a")).unwrap()),
        TimeSliceInterval::Short
    );
}

#[test]
fn later_entries_win_within_an_origin() {
    let sources = [
        source(Origin::Class, &[], 0, time_slicing("Long")),
        source(Origin::Class, &[], 1, time_slicing("Medium")),
        source(Origin::Claim, &[], 0, time_slicing("Short")),
        source(Origin::Claim, &[], 1, time_slicing("Long")),
    ];
    assert_eq!(
        interval_of(&resolve_one(&sources, gpu("a")).unwrap()),
        TimeSliceInterval::Long
    );
    assert_eq!(
        interval_of(&resolve_one(&sources[..2], gpu("a")).unwrap()),
        TimeSliceInterval::Medium
    );
}

#[test]
fn request_scoped_beats_unscoped() {
    let sources = [
        source(Origin::Claim, &["a"], 0, time_slicing("Short")),
        source(Origin::Claim, &[], 1, time_slicing("Long")),
    ];
    let got = resolve_claim("team/train", &sources, &[gpu("a"), gpu("b")]).unwrap();
    assert_eq!(interval_of(&got[0]), TimeSliceInterval::Short);
    assert_eq!(interval_of(&got[1]), TimeSliceInterval::Long);
}

#[test]
fn exact_subrequest_beats_parent_request() {
    let sources = [
        source(Origin::Claim, &["gpu/big"], 0, time_slicing("Short")),
        source(Origin::Claim, &["gpu"], 1, time_slicing("Long")),
    ];
    let got = resolve_claim("team/train", &sources, &[gpu("gpu/big"), gpu("gpu/small")]).unwrap();
    assert_eq!(interval_of(&got[0]), TimeSliceInterval::Short);
    assert_eq!(interval_of(&got[1]), TimeSliceInterval::Long);
    // A name that merely starts the same is not a parent.
    let sources = [source(Origin::Claim, &["gp"], 0, time_slicing("Short"))];
    let got = resolve_one(&sources, gpu("gpu/big")).unwrap();
    assert_eq!(
        got,
        EffectiveConfig::Gpu {
            sharing: Sharing::None
        }
    );
}

#[test]
fn merging_is_per_setting() {
    // The class picks a long slice; the claim only restates the strategy and
    // keeps the class's interval.
    let sources = [
        source(Origin::Class, &["a"], 0, time_slicing("Long")),
        source(
            Origin::Claim,
            &[],
            0,
            v("GpuConfig", json!({"sharing": {"strategy": "TimeSlicing"}})),
        ),
    ];
    assert_eq!(
        interval_of(&resolve_one(&sources, gpu("a")).unwrap()),
        TimeSliceInterval::Long
    );

    // Switching strategy drops the other strategy's settings.
    let sources = [
        source(Origin::Class, &["a"], 0, time_slicing("Long")),
        source(
            Origin::Claim,
            &[],
            0,
            v(
                "GpuConfig",
                json!({"sharing": {"strategy": "MPS", "mps": {"computePercent": 30}}}),
            ),
        ),
    ];
    assert_eq!(
        resolve_one(&sources, gpu("a")).unwrap(),
        EffectiveConfig::Gpu {
            sharing: Sharing::Mps {
                limits: Limits {
                    memory_bytes: 80 * GI,
                    compute_percent: 30,
                    shared_memory_bytes: None
                }
            }
        }
    );

    // Share limits merge field by field.
    let sources = [
        source(
            Origin::Class,
            &[],
            0,
            v("ShareConfig", json!({"processLimits": {"memory": "2Gi"}})),
        ),
        source(
            Origin::Claim,
            &[],
            0,
            v(
                "ShareConfig",
                json!({"processLimits": {"computePercent": 10}}),
            ),
        ),
    ];
    let got = resolve_one(&sources, share("s", IsolationLevel::Isolated, 8, 20)).unwrap();
    assert_eq!(
        got,
        EffectiveConfig::Share {
            limits: Some(Limits {
                memory_bytes: 2 * GI,
                compute_percent: 10,
                shared_memory_bytes: None
            })
        }
    );
}

// ---- wrong kind and device limits -------------------------------------

#[test]
fn scoped_config_of_the_wrong_kind_is_an_error() {
    let sources = [source(
        Origin::Claim,
        &["small"],
        2,
        v("GpuConfig", json!({"sharing": {"strategy": "TimeSlicing"}})),
    )];
    let err = resolve_one(&sources, mig("small")).unwrap_err();
    assert_eq!(err.problem().kind, ProblemKind::WrongKind);
    assert_eq!(err.problem().field, "kind");
    assert_eq!(err.claim(), "team/train");
    let text = err.to_string();
    for needle in [
        "claim team/train",
        "claim config #2 (requests: small)",
        "field `kind`",
        "GpuConfig does not apply",
        "type mig",
        "fix: use kind MigConfig",
    ] {
        assert!(text.contains(needle), "{needle:?} missing in: {text}");
    }

    // Class configs are checked the same way.
    let sources = [source(
        Origin::Class,
        &["small"],
        0,
        v("ShareConfig", json!({})),
    )];
    let err = resolve_one(&sources, gpu("small")).unwrap_err();
    assert!(err.to_string().contains("DeviceClass config #0"), "{err}");
}

#[test]
fn unscoped_config_applies_to_its_kind_only() {
    // One unscoped GpuConfig in a claim that got a GPU and a share: it shapes
    // the GPU and leaves the share alone.
    let sources = [source(Origin::Claim, &[], 0, time_slicing("Medium"))];
    let devices = [gpu("a"), share("b", IsolationLevel::Shared, 4, 10)];
    let got = resolve_claim("team/train", &sources, &devices).unwrap();
    assert_eq!(interval_of(&got[0]), TimeSliceInterval::Medium);
    assert_eq!(got[1], EffectiveConfig::Share { limits: None });

    // ...but it must fit some device of the claim.
    let err = resolve_claim("team/train", &sources, &[mig("a")]).unwrap_err();
    assert_eq!(err.problem().kind, ProblemKind::WrongKind);
    assert!(err.to_string().contains("applies to no device"), "{err}");
}

#[test]
fn limits_stay_within_what_the_claim_holds() {
    let over_memory = v("ShareConfig", json!({"processLimits": {"memory": "6Gi"}}));
    let err = resolve_one(
        &[source(Origin::Claim, &[], 0, over_memory)],
        share("s", IsolationLevel::Isolated, 4, 20),
    )
    .unwrap_err();
    assert_eq!(err.problem().kind, ProblemKind::NotApplicable);
    assert_eq!(err.problem().field, "processLimits.memory");
    assert!(err.to_string().contains("use at most 4Gi"), "{err}");

    let over_cores = v(
        "ShareConfig",
        json!({"processLimits": {"computePercent": 30}}),
    );
    let err = resolve_one(
        &[source(Origin::Class, &["s"], 1, over_cores)],
        share("s", IsolationLevel::Isolated, 4, 20),
    )
    .unwrap_err();
    assert_eq!(err.problem().field, "processLimits.computePercent");
    assert_eq!(err.at().unwrap().origin, Origin::Class);

    // The error names the config that set the offending value, not the last
    // one that applied.
    let sources = [
        source(
            Origin::Class,
            &[],
            0,
            v(
                "MigConfig",
                json!({"sharing": {"strategy": "MPS", "mps": {"memory": "20Gi"}}}),
            ),
        ),
        source(
            Origin::Claim,
            &[],
            7,
            v("MigConfig", json!({"sharing": {"strategy": "MPS"}})),
        ),
    ];
    let err = resolve_one(&sources, mig("m")).unwrap_err();
    assert_eq!(err.problem().field, "sharing.mps.memory");
    assert_eq!(err.at().unwrap().origin, Origin::Class);
}

#[test]
fn limits_on_a_shared_share_are_an_error() {
    let limits = v(
        "ShareConfig",
        json!({"processLimits": {"computePercent": 10}}),
    );
    let err = resolve_one(
        &[source(Origin::Claim, &[], 0, limits)],
        share("s", IsolationLevel::Shared, 4, 20),
    )
    .unwrap_err();
    assert_eq!(err.problem().kind, ProblemKind::NotApplicable);
    assert!(err.problem().fix.contains("Isolated"), "{err}");
    // An empty ShareConfig is fine on a Shared share.
    let got = resolve_one(
        &[source(Origin::Claim, &[], 0, v("ShareConfig", json!({})))],
        share("s", IsolationLevel::Shared, 4, 20),
    )
    .unwrap();
    assert_eq!(got, EffectiveConfig::Share { limits: None });
}

#[test]
fn undecodable_config_fails_the_claim_even_if_it_would_not_apply() {
    let sources = [source(
        Origin::Claim,
        &["other"],
        3,
        json!({"kind": "GpuConfig"}),
    )];
    let err = resolve_one(&sources, gpu("a")).unwrap_err();
    assert_eq!(err.problem().kind, ProblemKind::MissingField);
    assert_eq!(
        err.to_string(),
        "claim team/train: claim config #3 (requests: other): field `apiVersion`: missing; \
         fix: add `apiVersion: gpu.tessera.dev/v1alpha1`"
    );
}

// ---- robustness -------------------------------------------------------

/// xorshift64*: a tiny deterministic generator, enough to throw varied
/// inputs at the decoder without another crate.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// Random JSON built from the schema's own vocabulary, so that inputs get
/// past the header checks and exercise the field decoders.
fn random_json(rng: &mut Rng, depth: u32) -> Value {
    const KEYS: &[&str] = &[
        "apiVersion",
        "kind",
        "sharing",
        "strategy",
        "timeSlicing",
        "interval",
        "mps",
        "memory",
        "computePercent",
        "processLimits",
        "x",
        "",
    ];
    const STRINGS: &[&str] = &[
        API_VERSION,
        "GpuConfig",
        "MigConfig",
        "ShareConfig",
        "None",
        "TimeSlicing",
        "MPS",
        "Default",
        "Short",
        "Medium",
        "Long",
        "4Gi",
        "1.5Gi",
        "0",
        "16Ei",
        "-",
        "\u{0}",
        "gpu.tessera.dev/v2",
    ];
    match if depth == 0 {
        rng.below(4)
    } else {
        rng.below(6)
    } {
        0 => json!(rng.next() as i64 >> rng.below(64)),
        1 => json!(*rng.pick(STRINGS)),
        2 => json!(rng.below(2) == 0),
        3 => Value::Null,
        4 => Value::Array(
            (0..rng.below(3))
                .map(|_| random_json(rng, depth - 1))
                .collect(),
        ),
        _ => Value::Object(
            (0..rng.below(5))
                .map(|_| (rng.pick(KEYS).to_string(), random_json(rng, depth - 1)))
                .collect(),
        ),
    }
}

#[test]
fn decoder_survives_random_input() {
    let mut rng = Rng(0x7e55_e7a0_dead_beef);
    let seeds: Vec<Vec<u8>> = [
        time_slicing("Long"),
        v(
            "ShareConfig",
            json!({"processLimits": {"memory": "4Gi", "computePercent": 10}}),
        ),
        v(
            "MigConfig",
            json!({"sharing": {"strategy": "MPS", "mps": {"memory": 1024}}}),
        ),
    ]
    .iter()
    .map(|s| serde_json::to_vec(s).unwrap())
    .collect();

    for _ in 0..20_000 {
        // Arbitrary bytes.
        let len = rng.below(64);
        let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        let _ = decode(&bytes);

        // Valid configs with a few bytes flipped, cut or duplicated.
        let mut bytes = rng.pick(&seeds).clone();
        for _ in 0..=rng.below(4) {
            let at = rng.below(bytes.len());
            match rng.below(3) {
                0 => bytes[at] = rng.next() as u8,
                1 => bytes.truncate(at),
                _ => {
                    let tail = bytes[at..].to_vec();
                    bytes.extend(tail);
                }
            }
            if bytes.is_empty() {
                break;
            }
        }
        let _ = decode(&bytes);

        // Structured JSON from the schema's vocabulary, decoded and, when it
        // decodes, resolved against every device type.
        let mut value = random_json(&mut rng, 4);
        if let Value::Object(o) = &mut value
            && rng.below(4) != 0
        {
            o.insert("apiVersion".into(), json!(API_VERSION));
            o.insert(
                "kind".into(),
                json!(rng.pick(&["GpuConfig", "MigConfig", "ShareConfig"])),
            );
        }
        if decode_value(&value).is_ok() {
            let devices = [
                gpu("a"),
                mig("a"),
                share("a", IsolationLevel::Isolated, 4, 20),
                share("a", IsolationLevel::Shared, 4, 20),
            ];
            for d in devices {
                let _ = resolve_one(&[source(Origin::Claim, &["a"], 0, value.clone())], d);
            }
        }
    }

    // Deep nesting is refused by the JSON parser's depth limit, not by a
    // stack overflow.
    let deep = "[".repeat(5_000);
    assert_eq!(
        decode(deep.as_bytes()).unwrap_err().kind,
        ProblemKind::Malformed
    );
}

#[test]
fn quantity_parser_agrees_with_arithmetic() {
    let mut rng = Rng(42);
    let suffixes: [(&str, u64); 7] = [
        ("", 1),
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("k", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
    ];
    for _ in 0..10_000 {
        let (suffix, mult) = *rng.pick(&suffixes);
        let n = rng.next() >> rng.below(64);
        let text = format!("{n}{suffix}");
        match n.checked_mul(mult) {
            Some(bytes) => assert_eq!(Quantity::parse(&text), Ok(Quantity::from_bytes(bytes))),
            None => assert!(Quantity::parse(&text).is_err(), "{text}"),
        }
    }
}

#[test]
fn shared_memory_is_the_claims_and_only_under_mps() {
    let limits_of = |config: EffectiveConfig| match config {
        EffectiveConfig::Share { limits: Some(l) } => l,
        EffectiveConfig::Gpu {
            sharing: Sharing::Mps { limits },
        } => limits,
        other => panic!("no MPS limits: {other:?}"),
    };
    let isolated = share("s", IsolationLevel::Isolated, 4, 20);
    // Unset: the node's default.
    let got = resolve_one(&[], isolated.clone()).unwrap();
    assert_eq!(limits_of(got).shared_memory_bytes, None);
    // A class sets it, the claim raises it.
    let sources = [
        source(
            Origin::Class,
            &[],
            0,
            v("ShareConfig", json!({"sharedMemory": "256Mi"})),
        ),
        source(
            Origin::Claim,
            &[],
            0,
            v("ShareConfig", json!({"sharedMemory": "2Gi"})),
        ),
    ];
    let got = resolve_one(&sources, isolated.clone()).unwrap();
    assert_eq!(limits_of(got).shared_memory_bytes, Some(2 * GI));
    // Whole GPUs under MPS take it in sharing.mps.
    let mps = v(
        "GpuConfig",
        json!({"sharing": {"strategy": "MPS", "mps": {"sharedMemory": "1Gi"}}}),
    );
    let got = resolve_one(&[source(Origin::Claim, &[], 0, mps)], gpu("g")).unwrap();
    assert_eq!(limits_of(got).shared_memory_bytes, Some(GI));
    // Too small is refused at decoding, naming the field.
    let p = problem(v("ShareConfig", json!({"sharedMemory": "4Ki"})));
    assert_eq!(p.field, "sharedMemory", "{p:?}");
    let p = problem(v(
        "GpuConfig",
        json!({"sharing": {"strategy": "MPS", "mps": {"sharedMemory": 0}}}),
    ));
    assert_eq!(p.field, "sharing.mps.sharedMemory", "{p:?}");
    // A Shared share runs no daemon: asking is an error, not ignored.
    let err = resolve_one(
        &[source(
            Origin::Claim,
            &[],
            0,
            v("ShareConfig", json!({"sharedMemory": "1Gi"})),
        )],
        share("s", IsolationLevel::Shared, 4, 20),
    )
    .unwrap_err();
    assert_eq!(err.problem().field, "sharedMemory", "{err}");
}
