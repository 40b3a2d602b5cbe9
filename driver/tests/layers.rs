//! The driver crate's imports go one way: down the layers of [`UNITS`]
//! as [`MAY_USE`] allows, with no cycle between its files and none between
//! its top-level modules.
//!
//! Imports are read from the source text ([`tessera_test_kit::source`]).
//! The same reader holds every product function of the driver's crates to
//! at most 80 lines and every product file to at most 600.

#![allow(clippy::unwrap_used)] // test code: a panic is how it reports a failure

use std::collections::BTreeSet;
use std::path::Path;

use tessera_test_kit::source::{Crate, on_cycles};

/// The library: `src/bin/` is the command line, a crate of its own over it.
fn library() -> Crate {
    Crate::read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), &["bin"])
}

/// Every part of the crate and its layer: a file belongs to the unit of
/// the longest prefix of its module path listed here. docs/architecture.md
/// shows the same table.
const UNITS: &[(&str, &str)] = &[
    ("node", "node"),
    ("probe", "tools"),
    ("webhook", "tools"),
    ("kubelet", "kubelet"),
    ("binding", "binding"),
    ("publish", "publish"),
    ("guard", "guard"),
    ("metrics", "metrics"),
    ("health", "health"),
    ("prepare", "prepare"),
    ("host/mps", "adapters"),
    ("host/mig", "adapters"),
    ("host/time_slice", "adapters"),
    ("host", "port"),
    ("host/process", "process"),
    ("state", "state"),
    ("apiserver", "leaf"),
    ("cdi", "leaf"),
    ("claim_uid", "leaf"),
    ("tls", "leaf"),
    ("discovery", "leaf"),
    ("sync", "leaf"),
];

/// Which layers each layer may use, top to bottom. The prepare engine and
/// the host adapters never see each other: both see the port, and the
/// node process hands the adapters to the engine.
const MAY_USE: &[(&str, &[&str])] = &[
    ("root", &["*"]),
    (
        "node",
        &[
            "tools", "kubelet", "binding", "publish", "guard", "metrics", "health", "prepare",
            "adapters", "port", "process", "state", "leaf",
        ],
    ),
    ("tools", &["port", "state", "leaf"]),
    ("kubelet", &["prepare", "health", "state", "leaf"]),
    ("binding", &["prepare", "state", "leaf"]),
    (
        "publish",
        &["prepare", "health", "metrics", "state", "leaf"],
    ),
    ("guard", &["prepare", "metrics", "process", "state", "leaf"]),
    ("metrics", &["prepare", "health", "state", "leaf"]),
    ("health", &["state", "leaf"]),
    ("prepare", &["port", "process", "state", "leaf"]),
    ("adapters", &["port", "process", "state", "leaf"]),
    ("port", &["state", "leaf"]),
    ("process", &["state", "leaf"]),
    ("state", &["leaf"]),
    ("leaf", &["leaf"]),
];

/// The unit of a file's module path.
fn unit_of(module: &[String]) -> Option<&'static str> {
    if module.is_empty() {
        return Some("root");
    }
    let path = module.join("/");
    UNITS
        .iter()
        .filter(|(prefix, _)| path == *prefix || path.starts_with(&format!("{prefix}/")))
        .max_by_key(|(prefix, _)| prefix.len())
        .map(|(_, unit)| *unit)
}

fn may_use(from: &str, to: &str) -> bool {
    from == to
        || MAY_USE
            .iter()
            .find(|(unit, _)| *unit == from)
            .is_some_and(|(_, allowed)| allowed.contains(&"*") || allowed.contains(&to))
}

#[test]
fn no_file_imports_in_a_circle() {
    let krate = library();
    assert!(krate.files.len() > 50, "read {} files", krate.files.len());
    let cycles = on_cycles(&krate.file_edges());
    assert!(
        cycles.is_empty(),
        "files importing each other in a circle: {cycles:?}"
    );
}

#[test]
fn no_module_imports_in_a_circle() {
    let cycles = on_cycles(&library().module_edges());
    assert!(
        cycles.is_empty(),
        "top-level modules importing each other in a circle (make the imports point down \
         the layers: node-wide state in `state`, the host port in `host`): {cycles:?}"
    );
}

#[test]
fn every_file_has_a_layer() {
    let krate = library();
    let homeless: Vec<String> = krate
        .files
        .keys()
        .filter(|f| unit_of(f).is_none())
        .map(|f| krate.name(f))
        .collect();
    assert!(
        homeless.is_empty(),
        "files of no unit (add their module to UNITS in this test and to \
         docs/architecture.md): {homeless:?}"
    );
}

#[test]
fn imports_point_down_the_layers() {
    let krate = library();
    let mut against = Vec::new();
    for (from, found) in &krate.imports {
        for import in found {
            let (Some(a), Some(b)) = (unit_of(from), unit_of(&import.file)) else {
                continue;
            };
            if !may_use(a, b) {
                against.push(format!(
                    "{}:{} ({a}) uses {} ({b})",
                    krate.name(from),
                    import.line,
                    import.path.join("::")
                ));
            }
        }
    }
    assert!(
        against.is_empty(),
        "imports against the layers (see MAY_USE):\n{}",
        against.join("\n")
    );
}

#[test]
fn no_product_function_or_file_is_too_long() {
    let driver = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut long = Vec::new();
    for src in ["src", "fake-nvml/src", "fake-cuda/src", "test-kit/src"] {
        let krate = Crate::read(&driver.join(src), &[]);
        assert!(
            krate.files.len() > 3,
            "read {} files in {src}",
            krate.files.len()
        );
        long.extend(
            krate
                .too_long()
                .into_iter()
                .map(|l| format!("driver/{src}/{l}")),
        );
    }
    assert!(long.is_empty(), "too long:\n{}", long.join("\n"));
}

#[test]
fn the_layers_themselves_have_no_circle() {
    let edges: BTreeSet<(&str, &str)> = MAY_USE
        .iter()
        .flat_map(|(from, tos)| tos.iter().map(move |to| (*from, *to)))
        .filter(|(from, to)| from != to && *to != "*")
        .collect();
    assert!(on_cycles(&edges).is_empty(), "{:?}", on_cycles(&edges));
    for (unit, _) in MAY_USE {
        assert!(
            *unit == "root" || UNITS.iter().any(|(_, u)| u == unit),
            "{unit} is in MAY_USE but no module is in it"
        );
    }
}

#[test]
fn the_docs_list_the_units() {
    let doc = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/architecture.md"),
    )
    .unwrap();
    for (prefix, unit) in UNITS.iter().filter(|(_, u)| *u != "root") {
        let row = format!("| `{prefix}` | {unit} |");
        assert!(
            doc.contains(&row),
            "docs/architecture.md's module table lacks the row starting {row:?}"
        );
    }
}

#[test]
fn the_error_of_a_result_is_its_last_argument() {
    let found = |line| error_types(line).collect::<Vec<_>>();
    assert_eq!(found("fn f() -> Result<(), String> {"), ["String"]);
    assert_eq!(
        found("-> Result<BTreeMap<String, String>, PublishError>"),
        ["PublishError"]
    );
    assert_eq!(found("-> Result<(String, u8), Box<E>>"), ["Box<E>"]);
    assert!(found("-> io::Result<String>").is_empty());
}

#[test]
fn a_unit_is_its_longest_listed_prefix() {
    let module = |path: &str| path.split('/').map(str::to_owned).collect::<Vec<_>>();
    assert_eq!(unit_of(&module("host/mps/daemon")), Some("adapters"));
    assert_eq!(unit_of(&module("host/port")), Some("port"));
    assert_eq!(unit_of(&[]), Some("root"));
    assert_eq!(unit_of(&module("hostile")), None);
    assert!(may_use("prepare", "port") && !may_use("prepare", "adapters"));
}

/// The error type of each `Result<T, E>` a line names.
fn error_types(line: &str) -> impl Iterator<Item = &str> {
    line.match_indices("Result<").filter_map(|(at, _)| {
        let args = &line[at + "Result<".len()..];
        let (mut depth, mut comma) = (0, None);
        for (i, c) in args.char_indices() {
            match c {
                '<' | '(' => depth += 1,
                '>' | ')' if depth == 0 => return comma.map(|c: usize| args[c + 1..i].trim()),
                '>' | ')' => depth -= 1,
                ',' if depth == 0 => comma = Some(i),
                _ => {}
            }
        }
        None
    })
}

#[test]
fn library_errors_are_typed() {
    let driver = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut untyped = Vec::new();
    for (src, apart) in [
        ("src", &["bin"][..]),
        ("../controller/src", &[]),
        ("../api/src", &[]),
    ] {
        let krate = Crate::read(&driver.join(src), apart);
        for (module, (_, text)) in &krate.files {
            for (n, line) in text.lines().enumerate() {
                if error_types(line).any(|e| e == "String") || line.contains("anyhow") {
                    untyped.push(format!("{}:{}: {}", krate.name(module), n + 1, line.trim()));
                }
            }
        }
    }
    assert!(
        untyped.is_empty(),
        "library code returns typed errors (thiserror, keeping the cause as its source), \
         never a String or anyhow; the binary may use anyhow:\n{}",
        untyped.join("\n")
    );
}
