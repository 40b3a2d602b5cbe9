//! A crate's sources as its structure tests read them: product files and
//! their text (comments and `#[cfg(test)]` items blanked out, line for
//! line), the imports between files, and the length of every function.
//!
//! Imports are `use crate::...`/`use super::...` trees and inline
//! `crate::a::b` / `super::a` paths. A module's `mod.rs` (or the crate root)
//! using its own descendants is how a module shows its face, not a cycle,
//! and is not counted.

// A source tree that cannot be read is a broken checkout: the test panics.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The longest product function, signature to closing brace.
pub const MAX_FN_LINES: usize = 80;
/// The longest product file.
pub const MAX_FILE_LINES: usize = 600;

/// A file's module path below `src`: `model/plan` for `model/plan/mod.rs`,
/// `publisher/run` for `publisher/run.rs`, empty for `lib.rs`.
pub fn module_of(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .with_extension("")
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if (parts.len() == 1 && parts[0] == "lib") || parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts
}

/// The names of the modules a file declares under `#[cfg(test)]`
/// (`#[cfg(test)] mod fake_api;`): their files are test code.
pub fn test_modules(text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().map(str::trim).collect();
    lines
        .windows(2)
        .filter(|w| w[0] == "#[cfg(test)]")
        .filter_map(|w| w[1].strip_prefix("mod ")?.strip_suffix(';'))
        .map(str::to_owned)
        .collect()
}

/// The product files below `root`: not `tests.rs`, nothing under a `tests/`
/// folder, and no file of a module declared under `#[cfg(test)]`.
pub fn product_files(root: &Path) -> Vec<PathBuf> {
    let mut all = Vec::new();
    walk(root, &mut all);
    let mut test_files = BTreeSet::new();
    for path in &all {
        let text = std::fs::read_to_string(path).unwrap();
        // Children of `a/mod.rs` and `lib.rs` sit beside it; of `a/b.rs` in `a/b/`.
        let stem = path.file_stem().unwrap().to_string_lossy();
        let dir = if stem == "mod" || stem == "lib" {
            path.parent().unwrap().to_path_buf()
        } else {
            path.with_extension("")
        };
        for name in test_modules(&text) {
            test_files.insert(dir.join(format!("{name}.rs")));
            test_files.insert(dir.join(&name).join("mod.rs"));
        }
    }
    all.into_iter()
        .filter(|p| !test_files.contains(p))
        .collect()
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            if name != "tests" {
                walk(&path, out);
            }
        } else if name.ends_with(".rs") && name != "tests.rs" {
            out.push(path);
        }
    }
}

/// The product part of a file, line for line: comments and `#[cfg(test)]`
/// items blanked out, so line numbers still match the file.
pub fn product_text(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::with_capacity(lines.len());
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let t = line.trim_start();
        if t == "#[cfg(test)]" {
            let end = item_end(&lines, i + 1);
            out.extend(std::iter::repeat_n("", end + 1 - i));
            i = end + 1;
            continue;
        }
        out.push(if t.starts_with("//") {
            ""
        } else {
            line.split(" // ").next().unwrap_or(line)
        });
        i += 1;
    }
    out.join("\n")
}

/// The last line of the item that starts at `start` (after its attributes):
/// the line itself when it ends in `;` or closes on it, else the closing
/// brace at the item's indentation.
pub fn item_end(lines: &[&str], start: usize) -> usize {
    let mut first = start;
    while first < lines.len() && lines[first].trim_start().starts_with("#[") {
        first += 1;
    }
    let Some(line) = lines.get(first) else {
        return lines.len().saturating_sub(1);
    };
    let indent = &line[..line.len() - line.trim_start().len()];
    let head = line.trim_end();
    if head.ends_with(';') || (head.ends_with('}') && head.contains('{')) {
        return first;
    }
    let close = format!("{indent}}}");
    (first + 1..lines.len())
        .find(|&j| {
            let l = lines[j].trim_end();
            l.starts_with(&close) && l.len() <= close.len() + 1
        })
        .unwrap_or(lines.len() - 1)
}

/// Every path a `use` tree names, braces expanded and renames dropped:
/// `a::{b, c::d as e}` gives `a::b` and `a::c::d`.
pub fn expand(tree: &str) -> Vec<String> {
    let tree: String = tree
        .split(',')
        .map(|part| match part.find(" as ") {
            Some(at) => {
                let rest = &part[at + 4..];
                let kept = rest.trim_start_matches(|c: char| c.is_alphanumeric() || c == '_');
                format!("{}{}", &part[..at], kept.trim_start())
            }
            None => part.to_owned(),
        })
        .collect::<Vec<_>>()
        .join(",")
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    let Some(open) = tree.find('{') else {
        return vec![tree];
    };
    let close = tree.rfind('}').filter(|c| *c > open).unwrap_or(tree.len());
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

/// The module paths (from the crate root) a file's product text refers to,
/// with the line they are on.
pub fn referenced(module: &[String], text: &str) -> Vec<(usize, Vec<String>)> {
    let mut paths = Vec::new();
    // `use` statements, possibly over several lines.
    let mut from = 0;
    while let Some(at) = text[from..].find("use ") {
        let at = from + at;
        from = at + 4;
        let before = text[..at].chars().last();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let end = text[from..].find(';').map_or(text.len(), |e| from + e);
        let tree = text[from..end].trim_start();
        // Only the trees that start from here (not a "use" in a string).
        if !(tree.starts_with("crate::") || tree.starts_with("super::")) {
            continue;
        }
        let line = text[..at].matches('\n').count() + 1;
        paths.extend(expand(tree).into_iter().map(|p| (line, p)));
    }
    // Inline paths.
    for (n, line) in text.lines().enumerate() {
        for word in line.split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')) {
            let named = !word.ends_with("::");
            if named && (word.starts_with("crate::") || word.starts_with("super::")) {
                paths.push((n + 1, word.to_owned()));
            }
        }
    }
    paths
        .into_iter()
        .filter_map(|(line, p)| Some((line, resolve(module, &p)?)))
        .collect()
}

/// `crate::a::b::C` or `super::x` from `module`, as a path from the root.
pub fn resolve(module: &[String], path: &str) -> Option<Vec<String>> {
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

/// One import of one file: the line, the path as resolved, the file it
/// lands in.
pub struct Import {
    pub line: usize,
    pub path: Vec<String>,
    pub file: Vec<String>,
}

pub struct Crate {
    /// The crate's `src` folder.
    pub src: PathBuf,
    /// Module path -> the file's path below `src` and its product text.
    pub files: BTreeMap<Vec<String>, (PathBuf, String)>,
    /// File -> what it imports from other files (not its own descendants).
    pub imports: BTreeMap<Vec<String>, Vec<Import>>,
}

impl Crate {
    /// Reads the product files below `src`, leaving out the top-level
    /// folders named in `apart` (a `bin/` that is a crate of its own).
    pub fn read(src: &Path, apart: &[&str]) -> Crate {
        let root = src.to_path_buf();
        let files: BTreeMap<Vec<String>, (PathBuf, String)> = product_files(&root)
            .into_iter()
            .filter(|p| {
                let rel = p.strip_prefix(&root).unwrap_or(p);
                !apart.iter().any(|a| rel.starts_with(a))
            })
            .map(|p| {
                let rel = p.strip_prefix(&root).unwrap().to_path_buf();
                let text = product_text(&std::fs::read_to_string(&p).unwrap());
                (module_of(&rel), (rel, text))
            })
            .collect();
        let mut imports = BTreeMap::new();
        for (module, (_, text)) in &files {
            let mut found = Vec::new();
            for (line, path) in referenced(module, text) {
                // The longest prefix that is a file (the crate root at least).
                let file = (0..=path.len())
                    .rev()
                    .map(|n| path[..n].to_vec())
                    .find(|p| files.contains_key(p))
                    .unwrap_or_default();
                // Itself, or its own descendants (its face).
                if file.starts_with(module) {
                    continue;
                }
                found.push(Import { line, path, file });
            }
            imports.insert(module.clone(), found);
        }
        Crate {
            src: root,
            files,
            imports,
        }
    }

    pub fn name(&self, module: &[String]) -> String {
        self.files[module].0.display().to_string()
    }

    pub fn file_edges(&self) -> BTreeSet<(String, String)> {
        self.imports
            .iter()
            .flat_map(|(from, found)| found.iter().map(move |i| (from, &i.file)))
            .map(|(from, to)| (self.name(from), self.name(to)))
            .collect()
    }

    /// Imports between top-level modules (the crate root's left out: it
    /// only declares them).
    pub fn module_edges(&self) -> BTreeSet<(String, String)> {
        self.imports
            .iter()
            .filter(|(from, _)| !from.is_empty())
            .flat_map(|(from, found)| found.iter().map(move |i| (from, &i.file)))
            .filter(|(from, to)| !to.is_empty() && from[0] != to[0])
            .map(|(from, to)| (from[0].clone(), to[0].clone()))
            .collect()
    }

    /// Each product file over [`MAX_FILE_LINES`] and function over
    /// [`MAX_FN_LINES`], as a line saying where and what to do.
    pub fn too_long(&self) -> Vec<String> {
        let mut long = Vec::new();
        for (rel, text) in self.files.values() {
            let lines = std::fs::read_to_string(self.src.join(rel))
                .map(|t| t.lines().count())
                .unwrap_or(0);
            if lines > MAX_FILE_LINES {
                long.push(format!(
                    "{}: {lines} lines (at most {MAX_FILE_LINES}; move tests to a sibling \
                     tests.rs, or split the file)",
                    rel.display()
                ));
            }
            for (name, line, length) in functions(text) {
                if length > MAX_FN_LINES {
                    long.push(format!(
                        "{}:{line}: fn {name} is {length} lines (at most {MAX_FN_LINES}; \
                         split it into named phases)",
                        rel.display()
                    ));
                }
            }
        }
        long
    }
}

/// Edges that lie on a cycle of `edges`.
pub fn on_cycles<T: Ord + Clone>(edges: &BTreeSet<(T, T)>) -> BTreeSet<(T, T)> {
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

/// Each function of a product text: its name, first line and length in
/// lines, from the line of `fn` to its closing brace at the same
/// indentation. Declarations without a body are not functions here.
pub fn functions(text: &str) -> Vec<(String, usize, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(name) = fn_name(line) else {
            continue;
        };
        // A signature over several lines ends at the first `{` or `;`.
        let Some(open) = (i..lines.len()).find(|&j| {
            let l = lines[j].trim_end();
            l.ends_with('{') || l.ends_with(';') || l.ends_with('}')
        }) else {
            continue;
        };
        if lines[open].trim_end().ends_with(';') {
            continue;
        }
        let end = item_end(&lines, i);
        out.push((name, i + 1, end + 1 - i));
    }
    out
}

/// The name of the function a line begins, if it does.
pub fn fn_name(line: &str) -> Option<String> {
    let mut words = line.split_whitespace().peekable();
    while let Some(w) = words.next_if(|w| *w != "fn") {
        let qualifier = w.starts_with("pub")
            || matches!(
                w,
                "const" | "async" | "unsafe" | "extern" | "\"C\"" | "default"
            );
        if !qualifier {
            return None;
        }
    }
    words.next()?;
    let name: String = words
        .next()?
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    (!name.is_empty()).then_some(name)
}

#[cfg(test)]
mod tests;
