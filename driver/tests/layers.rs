//! The driver crate's imports go one way: down the layers of [`UNITS`]
//! as [`MAY_USE`] allows, with no cycle between its files and none between
//! its top-level modules.
//!
//! Imports are read from the source text: `use crate::...`/`use super::...`
//! trees and inline `crate::a::b` / `super::a` paths, outside test modules
//! and test files. A module's `mod.rs` using its own descendants is how a
//! module shows its face, not a cycle, and is not counted.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every part of the crate and its layer: a file belongs to the unit of
/// the longest prefix of its module path listed here. docs/architecture.md
/// shows the same table.
const UNITS: &[(&str, &str)] = &[
    ("node", "node"),
    ("probe", "tools"),
    ("webhook", "tools"),
    ("kubelet", "kubelet"),
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
    ("discovery", "leaf"),
    ("sync", "leaf"),
    ("lib", "root"),
];

/// Which layers each layer may use, top to bottom. The prepare engine and
/// the host adapters never see each other: both see the port, and the
/// node process hands the adapters to the engine.
const MAY_USE: &[(&str, &[&str])] = &[
    ("root", &["*"]),
    (
        "node",
        &[
            "tools", "kubelet", "publish", "guard", "metrics", "health", "prepare", "adapters",
            "port", "process", "state", "leaf",
        ],
    ),
    ("tools", &["port", "state", "leaf"]),
    ("kubelet", &["prepare", "health", "state", "leaf"]),
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

/// A file's module path below `src`: `mps/daemon`, `prepare` for
/// `prepare/mod.rs`, `lib` for the crate root.
fn module_of(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .with_extension("")
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts
}

fn product_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            // `bin/` is the command line, a crate of its own over this one.
            if name != "tests" && !(dir == src() && name == "bin") {
                product_files(&path, out);
            }
        } else if name.ends_with(".rs") && name != "tests.rs" && name != "main.rs" {
            out.push(path);
        }
    }
}

/// The product part of a file: without comments and its test module.
fn product_text(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let t = line.trim_start();
        if t.starts_with("#[cfg(test)]")
            && lines
                .peek()
                .is_some_and(|next| next.trim_start().starts_with("mod tests"))
        {
            break;
        }
        if t.starts_with("//") {
            continue;
        }
        out.push_str(line.split(" // ").next().unwrap_or(line));
        out.push('\n');
    }
    out
}

/// Every path a `use` tree names, braces expanded: `a::{b, c::d}` gives
/// `a::b` and `a::c::d`.
fn expand(tree: &str) -> Vec<String> {
    let tree: String = tree.chars().filter(|c| !c.is_whitespace()).collect();
    let Some(open) = tree.find('{') else {
        return vec![tree];
    };
    let close = tree.rfind('}').unwrap_or(tree.len());
    let prefix = &tree[..open];
    let inner = &tree[open + 1..close];
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (i, ch) in inner.char_indices() {
        match ch {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    parts
        .into_iter()
        .filter(|p| !p.is_empty())
        .flat_map(|p| expand(&format!("{prefix}{p}")))
        .collect()
}

/// The module paths (from the crate root) a file's text refers to.
fn referenced(module: &[String], text: &str) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    // `use` statements, possibly over several lines.
    let mut rest = text;
    while let Some(at) = rest.find("use ") {
        let before = rest[..at].chars().last();
        rest = &rest[at + 4..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let end = rest.find(';').unwrap_or(rest.len());
        paths.extend(expand(&rest[..end]));
    }
    // Inline paths.
    for word in text.split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')) {
        if word.starts_with("crate::") || word.starts_with("super::") {
            paths.push(word.to_owned());
        }
    }
    paths
        .into_iter()
        .filter_map(|p| resolve(module, &p))
        .collect()
}

/// `crate::a::b::C` or `super::x` from `module`, as a path from the root.
fn resolve(module: &[String], path: &str) -> Option<Vec<String>> {
    let mut parts: Vec<&str> = path.split("::").filter(|p| !p.is_empty()).collect();
    let mut base: Vec<String> = match *parts.first()? {
        "crate" => {
            parts.remove(0);
            Vec::new()
        }
        "super" => {
            let mut base = module.to_vec();
            while parts.first() == Some(&"super") {
                parts.remove(0);
                base.pop()?;
            }
            base
        }
        _ => return None,
    };
    base.extend(parts.iter().map(|p| p.to_string()));
    Some(base)
}

struct Crate {
    /// Module paths that are files.
    files: BTreeSet<Vec<String>>,
    /// File -> files it imports.
    edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
}

impl Crate {
    fn read() -> Crate {
        let root = src();
        let mut paths = Vec::new();
        product_files(&root, &mut paths);
        let files: BTreeSet<Vec<String>> = paths
            .iter()
            .map(|p| module_of(p.strip_prefix(&root).unwrap()))
            .collect();
        let mut edges = BTreeMap::new();
        for path in &paths {
            let module = module_of(path.strip_prefix(&root).unwrap());
            let text = product_text(&std::fs::read_to_string(path).unwrap());
            let mut to = BTreeSet::new();
            for target in referenced(&module, &text) {
                // The longest prefix that is a file.
                let Some(file) = (1..=target.len())
                    .rev()
                    .map(|n| target[..n].to_vec())
                    .find(|p| files.contains(p))
                else {
                    continue;
                };
                // Itself, or a module's own descendants (its face).
                if file == module || (file.starts_with(&module) && !module.is_empty()) {
                    continue;
                }
                to.insert(file);
            }
            edges.insert(module, to);
        }
        Crate { files, edges }
    }

    /// Edges between top-level modules.
    fn module_edges(&self) -> BTreeSet<(String, String)> {
        let mut out = BTreeSet::new();
        for (from, tos) in &self.edges {
            for to in tos {
                if from[0] != to[0] && from[0] != "lib" {
                    out.insert((from[0].clone(), to[0].clone()));
                }
            }
        }
        out
    }
}

/// Edges that lie on a cycle of `edges`.
fn on_cycles<T: Ord + Clone>(edges: &BTreeSet<(T, T)>) -> BTreeSet<(T, T)> {
    let reaches = |from: &T, to: &T| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.clone()];
        while let Some(n) = todo.pop() {
            if &n == to {
                return true;
            }
            if seen.insert(n.clone()) {
                todo.extend(
                    edges
                        .iter()
                        .filter(|(a, _)| *a == n)
                        .map(|(_, b)| b.clone()),
                );
            }
        }
        false
    };
    edges
        .iter()
        .filter(|(a, b)| reaches(b, a))
        .cloned()
        .collect()
}

#[test]
fn no_file_imports_in_a_circle() {
    let krate = Crate::read();
    assert!(krate.files.len() > 50, "read {} files", krate.files.len());
    let edges: BTreeSet<(String, String)> = krate
        .edges
        .iter()
        .flat_map(|(from, tos)| {
            tos.iter()
                .filter(|to| to[0] == from[0])
                .map(|to| (from.join("/"), to.join("/")))
        })
        .collect();
    let cycles = on_cycles(&edges);
    assert!(
        cycles.is_empty(),
        "files importing each other in a circle: {cycles:?}"
    );
}

#[test]
fn no_module_imports_in_a_circle() {
    let krate = Crate::read();
    let cycles = on_cycles(&krate.module_edges());
    assert!(
        cycles.is_empty(),
        "top-level modules importing each other in a circle (make the imports point down \
         the layers: node-wide state in `state`, the host port in `host`): {cycles:?}"
    );
}

#[test]
fn every_file_has_a_layer() {
    let krate = Crate::read();
    let homeless: Vec<String> = krate
        .files
        .iter()
        .filter(|f| unit_of(f).is_none())
        .map(|f| f.join("/"))
        .collect();
    assert!(
        homeless.is_empty(),
        "files of no unit (add their module to UNITS in this test and to \
         docs/architecture.md): {homeless:?}"
    );
}

#[test]
fn imports_point_down_the_layers() {
    let krate = Crate::read();
    let mut against = Vec::new();
    for (from, tos) in &krate.edges {
        for to in tos {
            let (Some(a), Some(b)) = (unit_of(from), unit_of(to)) else {
                continue;
            };
            if !may_use(a, b) {
                against.push(format!(
                    "{} ({a}) uses {} ({b})",
                    from.join("/"),
                    to.join("/")
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
fn the_layers_themselves_have_no_circle() {
    let edges: BTreeSet<(&str, &str)> = MAY_USE
        .iter()
        .flat_map(|(from, tos)| tos.iter().map(move |to| (*from, *to)))
        .filter(|(from, to)| from != to && *to != "*")
        .collect();
    assert!(on_cycles(&edges).is_empty(), "{:?}", on_cycles(&edges));
    for (unit, _) in MAY_USE {
        assert!(
            UNITS.iter().any(|(_, u)| u == unit),
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
fn the_reader_finds_what_a_use_tree_names() {
    assert_eq!(
        expand("crate::{a::B, c::{d, e::F}}"),
        ["crate::a::B", "crate::c::d", "crate::c::e::F"]
    );
    let module = vec!["mps".to_owned(), "daemon".to_owned()];
    assert_eq!(
        resolve(&module, "super::paths::CONTROL"),
        Some(vec!["mps".into(), "paths".into(), "CONTROL".into()])
    );
    assert_eq!(resolve(&module, "std::fs"), None);
    let module = |path: &str| path.split('/').map(str::to_owned).collect::<Vec<_>>();
    assert_eq!(unit_of(&module("host/mps/daemon")), Some("adapters"));
    assert_eq!(unit_of(&module("host/port")), Some("port"));
    assert_eq!(unit_of(&module("hostile")), None);
    assert!(may_use("prepare", "port") && !may_use("prepare", "adapters"));
    let edges: BTreeSet<(u8, u8)> = [(1, 2), (2, 1), (2, 3)].into();
    assert_eq!(on_cycles(&edges), [(1, 2), (2, 1)].into());
}
