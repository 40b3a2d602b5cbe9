//! Results of a run: the summary table printed at the end, JUnit XML and
//! Markdown.

use std::fmt::Write as _;
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Pass,
    Fail,
    Skip,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Pass => "PASS",
            Status::Fail => "FAIL",
            Status::Skip => "SKIP",
        }
    }
}

/// One check's outcome: `message` is the one line saying what it proved or
/// exactly what is wrong; `details` the evidence (one line each).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckResult {
    pub id: String,
    pub title: String,
    pub status: Status,
    pub message: String,
    pub details: Vec<String>,
    pub duration: Duration,
}

/// What the run was against, and its results.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Report {
    pub started: String,
    pub cluster: String,
    pub driver: String,
    pub node: String,
    pub namespace: String,
    pub classes: Vec<(String, String)>,
    pub results: Vec<CheckResult>,
}

impl Report {
    pub fn count(&self, s: Status) -> usize {
        self.results.iter().filter(|r| r.status == s).count()
    }

    /// All checks passed or were skipped.
    pub fn passed(&self) -> bool {
        self.count(Status::Fail) == 0
    }

    fn totals(&self) -> String {
        format!(
            "{} passed, {} failed, {} skipped",
            self.count(Status::Pass),
            self.count(Status::Fail),
            self.count(Status::Skip)
        )
    }

    /// The plain-text table printed at the end of a run.
    pub fn summary_table(&self) -> String {
        let id_w = self
            .results
            .iter()
            .map(|r| r.id.len())
            .max()
            .unwrap_or(5)
            .max(5);
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{:<id_w$}  {:<6}  {:>7}  RESULT",
            "CHECK", "STATUS", "TIME"
        );
        for r in &self.results {
            let _ = writeln!(
                s,
                "{:<id_w$}  {:<6}  {:>6.1}s  {}",
                r.id,
                r.status.as_str(),
                r.duration.as_secs_f64(),
                r.message
            );
        }
        let _ = writeln!(s, "{}", self.totals());
        s
    }

    pub fn junit(&self) -> String {
        let total: f64 = self.results.iter().map(|r| r.duration.as_secs_f64()).sum();
        let mut s = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
        let _ = writeln!(
            s,
            "<testsuites name=\"tessera-conformance\" tests=\"{}\" failures=\"{}\" skipped=\"{}\" time=\"{total:.3}\">",
            self.results.len(),
            self.count(Status::Fail),
            self.count(Status::Skip)
        );
        let _ = writeln!(
            s,
            "  <testsuite name=\"KAR-0003 GPU sharing ({})\" tests=\"{}\" failures=\"{}\" skipped=\"{}\" time=\"{total:.3}\" timestamp=\"{}\">",
            xml_escape(&self.driver),
            self.results.len(),
            self.count(Status::Fail),
            self.count(Status::Skip),
            xml_escape(&self.started)
        );
        let _ = writeln!(s, "    <properties>");
        for (k, v) in self.properties() {
            let _ = writeln!(
                s,
                "      <property name=\"{}\" value=\"{}\"/>",
                xml_escape(&k),
                xml_escape(&v)
            );
        }
        let _ = writeln!(s, "    </properties>");
        for r in &self.results {
            let _ = write!(
                s,
                "    <testcase classname=\"tessera-conformance\" name=\"{}\" time=\"{:.3}\">",
                xml_escape(&r.id),
                r.duration.as_secs_f64()
            );
            match r.status {
                Status::Pass => {}
                Status::Fail => {
                    let _ = write!(
                        s,
                        "\n      <failure message=\"{}\">{}</failure>",
                        xml_escape(&r.message),
                        xml_escape(&r.details.join("\n"))
                    );
                }
                Status::Skip => {
                    let _ = write!(
                        s,
                        "\n      <skipped message=\"{}\"/>",
                        xml_escape(&r.message)
                    );
                }
            }
            let mut out = vec![r.message.clone()];
            out.extend(r.details.iter().cloned());
            let _ = writeln!(
                s,
                "\n      <system-out>{}</system-out>\n    </testcase>",
                xml_escape(&out.join("\n"))
            );
        }
        s.push_str("  </testsuite>\n</testsuites>\n");
        s
    }

    fn properties(&self) -> Vec<(String, String)> {
        let mut p = vec![
            ("cluster".to_owned(), self.cluster.clone()),
            ("driver".to_owned(), self.driver.clone()),
            ("node".to_owned(), self.node.clone()),
            ("namespace".to_owned(), self.namespace.clone()),
        ];
        p.extend(
            self.classes
                .iter()
                .map(|(k, v)| (format!("class.{k}"), v.clone())),
        );
        p
    }

    pub fn markdown(&self) -> String {
        let mut s = String::from("# Tessera conformance report (KAR-0003 GPU sharing)\n\n");
        let _ = writeln!(s, "- Started: {}", md_inline(&self.started));
        for (k, v) in self.properties() {
            let _ = writeln!(s, "- {}: `{}`", k, md_inline(&v));
        }
        let _ = writeln!(
            s,
            "- Result: **{}** ({})\n",
            if self.passed() { "PASS" } else { "FAIL" },
            self.totals()
        );
        s.push_str("| Check | Status | Time | Result |\n| --- | --- | ---: | --- |\n");
        for r in &self.results {
            let _ = writeln!(
                s,
                "| `{}` | {} | {:.1}s | {} |",
                r.id,
                r.status.as_str(),
                r.duration.as_secs_f64(),
                md_cell(&r.message)
            );
        }
        s.push_str("\n## Evidence\n");
        for r in &self.results {
            let _ = writeln!(
                s,
                "\n### `{}`: {}\n\n{}\n",
                r.id,
                md_inline(&r.title),
                md_inline(&r.message)
            );
            if !r.details.is_empty() {
                s.push_str("```\n");
                for d in &r.details {
                    let _ = writeln!(s, "{}", d.replace("```", "'''"));
                }
                s.push_str("```\n");
            }
        }
        s
    }
}

/// Escapes text for XML attributes and content; drops characters XML 1.0
/// cannot carry.
pub fn xml_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\n' | '\t' | '\r' => out.push(c),
            c if (c as u32) < 0x20 || c == '\u{FFFE}' || c == '\u{FFFF}' => out.push('\u{FFFD}'),
            c => out.push(c),
        }
    }
    out
}

fn md_inline(s: &str) -> String {
    s.replace('\n', " ")
}

fn md_cell(s: &str) -> String {
    md_inline(s).replace('|', "\\|")
}

/// `YYYY-MM-DDTHH:MM:SSZ` for seconds since the Unix epoch.
pub fn utc_timestamp(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Report {
        let r = |id: &str, status, message: &str| CheckResult {
            id: id.into(),
            title: format!("title of {id}"),
            status,
            message: message.into(),
            details: vec![format!("pod {id}-0: <evidence> & more")],
            duration: Duration::from_millis(1500),
        };
        Report {
            started: "2026-11-22T20:00:00Z".into(),
            cluster: "https://127.0.0.1:6443".into(),
            driver: "gpu.tessera.dev".into(),
            node: "tessera-node".into(),
            namespace: "tessera-conformance-abcde".into(),
            classes: vec![("gpu".into(), "gpu.tessera.dev".into())],
            results: vec![
                r(
                    "logical-gpus",
                    Status::Pass,
                    "GPU-a is published as 3 devices",
                ),
                r("mig-distinct", Status::Skip, "no MIG devices published"),
                r("shared-claim", Status::Fail, "pod \"x\" saw <none> | GPU-b"),
            ],
        }
    }

    #[test]
    fn summary_table_lists_every_check_and_totals() {
        let t = sample().summary_table();
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("CHECK"));
        assert!(lines[1].starts_with("logical-gpus  PASS"), "{t}");
        assert!(lines[2].contains("SKIP") && lines[2].ends_with("no MIG devices published"));
        assert!(lines[3].contains("   1.5s  "));
        assert_eq!(lines[4], "1 passed, 1 failed, 1 skipped");
        assert!(!sample().passed());
    }

    #[test]
    fn junit_escapes_and_marks_failures_and_skips() {
        let x = sample().junit();
        assert!(x.contains("tests=\"3\" failures=\"1\" skipped=\"1\""));
        assert!(x.contains(
            "<testcase classname=\"tessera-conformance\" name=\"logical-gpus\" time=\"1.500\">"
        ));
        assert!(x.contains("<skipped message=\"no MIG devices published\"/>"));
        assert!(x.contains("<failure message=\"pod &quot;x&quot; saw &lt;none&gt; | GPU-b\">pod shared-claim-0: &lt;evidence&gt; &amp; more</failure>"));
        assert!(!x.contains("<evidence>"));
        assert_eq!(x.matches("<testcase ").count(), 3);
        assert_eq!(x.matches("</testcase>").count(), 3);
    }

    #[test]
    fn xml_escape_handles_control_characters() {
        assert_eq!(xml_escape("a<b>&\"'"), "a&lt;b&gt;&amp;&quot;&apos;");
        assert_eq!(xml_escape("x\u{1b}[0m\ny"), "x\u{FFFD}[0m\ny");
    }

    #[test]
    fn markdown_has_a_row_and_evidence_per_check() {
        let m = sample().markdown();
        assert!(m.contains("| `shared-claim` | FAIL | 1.5s | pod \"x\" saw <none> \\| GPU-b |"));
        assert!(m.contains("### `mig-distinct`: title of mig-distinct"));
        assert!(m.contains("- Result: **FAIL** (1 passed, 1 failed, 1 skipped)"));
        assert!(m.contains("- driver: `gpu.tessera.dev`"));
    }

    #[test]
    fn formats_utc_timestamps() {
        assert_eq!(utc_timestamp(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_timestamp(1_795_380_558), "2026-11-22T20:49:18Z");
    }
}
