use std::collections::BTreeSet;
use std::path::Path;

use super::*;

#[test]
fn the_reader_finds_what_a_file_imports() {
    let fixture = "\
use std::fmt;
use crate::{a::{b, c as d}, e};
pub(crate) use super::f::G;
use super::{
    h::I,
    j,
};

fn k() -> super::super::X {
    crate::l::m();
}

#[cfg(test)]
mod t {
    use crate::z;
}
";
    let module = vec!["p".to_owned(), "q".to_owned()];
    let found: BTreeSet<String> = referenced(&module, &product_text(fixture))
        .into_iter()
        .map(|(line, path)| format!("{line}:{}", path.join("::")))
        .collect();
    let expected: BTreeSet<String> = [
        "2:a::b",
        "2:a::c",
        "2:e",
        "3:p::f::G",
        "4:p::h::I",
        "4:p::j",
        "9:X",
        "10:l::m",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    assert_eq!(found, expected);
    assert_eq!(module_of(Path::new("model/plan/mod.rs")), ["model", "plan"]);
    assert_eq!(
        module_of(Path::new("publisher/run.rs")),
        ["publisher", "run"]
    );
    assert!(module_of(Path::new("lib.rs")).is_empty());
    assert_eq!(
        test_modules("#[cfg(test)]\nmod fake_api;\nmod real;\n"),
        ["fake_api"]
    );
    let edges: BTreeSet<(u8, u8)> = [(1, 2), (2, 1), (2, 3)].into();
    assert_eq!(on_cycles(&edges), [(1, 2), (2, 1)].into());
}

#[test]
fn the_measure_counts_a_function_from_fn_to_its_brace() {
    let fixture = "\
pub(crate) async fn three() {
    one();
}

impl A {
    fn where_clause<T>(
        t: T,
    ) -> u32
    where
        T: Copy,
    {
        if x {
            y();
        }
        0
    }

    fn one_line(&self) -> u32 { 1 }
}

trait B {
    fn declared(&self);
}

#[cfg(test)]
mod tests {
    fn hidden() {
        long();
    }
}
";
    let found = functions(&product_text(fixture));
    let expected: Vec<(String, usize, usize)> = vec![
        ("three".into(), 1, 3),
        ("where_clause".into(), 6, 11),
        ("one_line".into(), 18, 1),
    ];
    assert_eq!(found, expected);
    assert_eq!(fn_name("    f: fn(u32) -> u32,"), None);
    assert_eq!(
        fn_name("    pub const unsafe fn x_y<T>("),
        Some("x_y".into())
    );
}
