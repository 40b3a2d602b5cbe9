//! The self-test's result: one row per step, printed as a table.

use std::fmt::Write as _;

/// What a step found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// What Tessera promises held.
    Holds,
    /// It did not: the self-test fails.
    Fails(String),
    /// Outside what this driver generation can enforce (said in
    /// docs/isolation.md); reported, not a failure.
    NotEnforced(String),
    /// A question about the driver, not a promise: its answer (`None`: not
    /// measured here); never a failure.
    Answer(Option<bool>),
}

impl Verdict {
    /// `Holds` without problems, else `Fails` naming them.
    pub fn of(problems: Vec<String>) -> Verdict {
        if problems.is_empty() {
            Verdict::Holds
        } else {
            Verdict::Fails(problems.join("; "))
        }
    }

    fn label(&self) -> &'static str {
        match self {
            Verdict::Holds => "holds",
            Verdict::Fails(_) => "FAILS",
            Verdict::NotEnforced(_) => "not enforced on this generation",
            Verdict::Answer(Some(true)) => "answer: yes",
            Verdict::Answer(Some(false)) => "answer: no",
            Verdict::Answer(None) => "not measured",
        }
    }
}

/// One step of the self-test.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub step: String,
    /// The claim it concerns (`a`, `b`, `a+b`).
    pub claim: String,
    /// What was measured.
    pub got: String,
    pub verdict: Verdict,
}

#[derive(Debug, Default)]
pub struct Table {
    pub rows: Vec<Row>,
}

impl Table {
    pub fn push(&mut self, step: impl Into<String>, claim: &str, got: String, verdict: Verdict) {
        let row = Row {
            step: step.into(),
            claim: claim.to_owned(),
            got,
            verdict,
        };
        eprintln!(
            "[selftest] {} ({}): {}",
            row.step,
            row.claim,
            row.verdict.label()
        );
        self.rows.push(row);
    }

    /// Whether every step held (or is outside what the generation enforces).
    pub fn passed(&self) -> bool {
        !self
            .rows
            .iter()
            .any(|r| matches!(r.verdict, Verdict::Fails(_)))
    }

    /// The table: step, claim, verdict, then what was measured and why.
    pub fn render(&self) -> String {
        let width = |f: fn(&Row) -> usize, title: &str| {
            self.rows.iter().map(f).max().unwrap_or(0).max(title.len())
        };
        let (ws, wc) = (
            width(|r| r.step.len(), "STEP"),
            width(|r| r.claim.len(), "CLAIM"),
        );
        let wv = width(|r| r.verdict.label().len(), "VERDICT");
        let mut out = format!(
            "{:ws$}  {:wc$}  {:wv$}  MEASURED\n",
            "STEP", "CLAIM", "VERDICT"
        );
        for r in &self.rows {
            let _ = writeln!(
                out,
                "{:ws$}  {:wc$}  {:wv$}  {}",
                r.step,
                r.claim,
                r.verdict.label(),
                r.got
            );
            if let Verdict::Fails(why) | Verdict::NotEnforced(why) = &r.verdict {
                let _ = writeln!(out, "{:ws$}  {:wc$}  {:wv$}    -> {why}", "", "", "");
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_step_fails_the_table_and_an_unenforced_one_does_not() {
        let mut t = Table::default();
        t.push("probe", "a", "32 SMs".into(), Verdict::Holds);
        t.push(
            "leave MPS",
            "a",
            "132 SMs".into(),
            Verdict::NotEnforced("Default compute mode".into()),
        );
        t.push(
            "MPS client without /dev/nvidia<N>",
            "b",
            "not measured (simulated)".into(),
            Verdict::Answer(None),
        );
        t.push(
            "the same, on a GPU",
            "b",
            "ran".into(),
            Verdict::Answer(Some(false)),
        );
        assert!(t.passed(), "a question's answer is never a failure");
        let text = t.render();
        let question = text
            .lines()
            .find(|l| l.starts_with("MPS client without"))
            .expect("the question's row");
        assert!(
            question.contains("  not measured  ") && question.ends_with("(simulated)"),
            "{text}"
        );
        assert!(text.contains("answer: no"), "{text}");
        assert!(text.contains("not enforced on this generation"), "{text}");
        assert!(text.contains("-> Default compute mode"), "{text}");
        t.push(
            "unprepare",
            "a",
            "daemon left".into(),
            Verdict::of(vec!["pid 7 runs".into()]),
        );
        assert!(!t.passed());
        assert!(t.render().contains("FAILS"));
        assert_eq!(Verdict::of(Vec::new()), Verdict::Holds);
    }
}
