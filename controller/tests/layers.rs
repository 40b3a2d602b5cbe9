//! The controller crate keeps its shape: the model is pure (nothing under
//! `model/` imports the publisher), no two files import each other in a
//! circle, and no product function or file outgrows what a reader takes in
//! at once.
//!
//! Everything is read from the source text ([`tessera_test_kit::source`]).

#![allow(clippy::unwrap_used)] // test code: a panic is how it reports a failure

use std::path::Path;

use tessera_test_kit::source::{Crate, on_cycles};

fn read() -> Crate {
    Crate::read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), &[])
}

#[test]
fn the_model_never_imports_the_publisher() {
    let krate = read();
    let mut wrong = Vec::new();
    for (from, found) in &krate.imports {
        if from.first().is_some_and(|m| m == "model") {
            for i in found
                .iter()
                .filter(|i| i.path.first().is_some_and(|m| m == "publisher"))
            {
                wrong.push(format!(
                    "{}:{}: {}",
                    krate.name(from),
                    i.line,
                    i.path.join("::")
                ));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "the model is pure: it computes slices and knows no API server, so nothing \
         under model/ may import the publisher:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn no_file_imports_in_a_circle() {
    let krate = read();
    assert!(krate.files.len() > 20, "read {} files", krate.files.len());
    let edges = krate.file_edges();
    assert!(edges.len() > 20, "read {} imports", edges.len());
    let cycles = on_cycles(&edges);
    assert!(
        cycles.is_empty(),
        "files importing each other in a circle (move what both need into a \
         file they both import): {cycles:?}"
    );
}

#[test]
fn no_product_function_or_file_is_too_long() {
    let long = read().too_long();
    assert!(long.is_empty(), "too long:\n{}", long.join("\n"));
}
