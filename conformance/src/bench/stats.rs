//! Latency samples and what a benchmark reports about them.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

/// Latencies of one phase (prepare or unprepare) of one run.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Summary {
    pub calls: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub mean_ms: f64,
    pub max_ms: f64,
    /// Claims completed per second of the phase's wall time.
    pub claims_per_s: f64,
}

impl Summary {
    /// `wall` is the whole phase, from the first call to the last answer.
    pub fn of(samples: &[Duration], claims: usize, wall: Duration) -> Summary {
        let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
        ms.sort_by(f64::total_cmp);
        let mean = if ms.is_empty() {
            0.0
        } else {
            ms.iter().sum::<f64>() / ms.len() as f64
        };
        Summary {
            calls: ms.len(),
            p50_ms: quantile(&ms, 0.50),
            p99_ms: quantile(&ms, 0.99),
            mean_ms: mean,
            max_ms: ms.last().copied().unwrap_or(0.0),
            claims_per_s: if wall.is_zero() {
                0.0
            } else {
                claims as f64 / wall.as_secs_f64()
            },
        }
    }
}

/// Nearest-rank quantile of sorted values (0 for none).
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// A Prometheus histogram as scraped: cumulative bucket counts by upper
/// bound, plus sum and count.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    pub buckets: Vec<(f64, f64)>,
    pub sum: f64,
    pub count: f64,
}

impl Histogram {
    /// The observations made between `before` and `self` (same series).
    pub fn since(&self, before: &Histogram) -> Histogram {
        let buckets = self
            .buckets
            .iter()
            .map(|(le, n)| {
                let old = before
                    .buckets
                    .iter()
                    .find(|(b, _)| b == le)
                    .map_or(0.0, |(_, n)| *n);
                (*le, n - old)
            })
            .collect();
        Histogram {
            buckets,
            sum: self.sum - before.sum,
            count: self.count - before.count,
        }
    }

    pub fn mean(&self) -> f64 {
        if self.count > 0.0 {
            self.sum / self.count
        } else {
            0.0
        }
    }

    /// Quantile estimated by linear interpolation inside its bucket, as
    /// PromQL's `histogram_quantile` does.
    pub fn quantile(&self, q: f64) -> f64 {
        if self.count <= 0.0 {
            return 0.0;
        }
        let rank = q * self.count;
        let mut lower = (0.0, 0.0);
        for &(le, n) in &self.buckets {
            if n >= rank {
                if le.is_infinite() {
                    return lower.0;
                }
                let width = n - lower.1;
                let into = if width > 0.0 {
                    (rank - lower.1) / width
                } else {
                    0.0
                };
                return lower.0 + (le - lower.0) * into;
            }
            lower = (le, n);
        }
        lower.0
    }
}

/// Reads one histogram series from Prometheus text: the `<name>_bucket`,
/// `_sum` and `_count` lines whose labels include every `want` pair. Series
/// that differ in other labels are added together.
pub fn parse_histogram(text: &str, name: &str, want: &[(&str, &str)]) -> Histogram {
    let mut h = Histogram::default();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        let (metric, labels) = match series.split_once('{') {
            Some((m, rest)) => (m, rest.trim_end_matches('}')),
            None => (series, ""),
        };
        let labels = parse_labels(labels);
        let has = |k: &str, v: &str| labels.iter().any(|(lk, lv)| lk == k && lv == v);
        if !want.iter().all(|(k, v)| has(k, v)) {
            continue;
        }
        match metric.strip_prefix(name) {
            Some("_bucket") => {
                let Some(le) = labels.iter().find(|(k, _)| k == "le") else {
                    continue;
                };
                let le = if le.1 == "+Inf" {
                    f64::INFINITY
                } else {
                    le.1.parse().unwrap_or(f64::NAN)
                };
                match h.buckets.iter_mut().find(|(b, _)| *b == le) {
                    Some(b) => b.1 += value,
                    None => h.buckets.push((le, value)),
                }
            }
            Some("_sum") => h.sum += value,
            Some("_count") => h.count += value,
            _ => {}
        }
    }
    h.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    h
}

const VERBS: [&str; 9] = [
    "GET",
    "LIST",
    "WATCH",
    "POST",
    "PUT",
    "PATCH",
    "APPLY",
    "DELETE",
    "DELETECOLLECTION",
];

/// Requests the API server counted (`apiserver_request_total`) for each
/// (resource, subresource) of `resources`, by `"<VERB> <resource>[/<sub>]"`
/// (`"<VERB> /<sub>"` without a resource: discovery), dry runs apart.
pub fn requests_of(metrics: &str, resources: &[(&str, &str)]) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for &(resource, sub) in resources {
        let what = match (resource, sub) {
            ("", sub) => format!("/{sub}"),
            (resource, "") => resource.to_owned(),
            (resource, sub) => format!("{resource}/{sub}"),
        };
        for verb in VERBS {
            for (dry, suffix) in [("", ""), ("All", " (dry run)")] {
                let labels = [
                    ("resource", resource),
                    ("subresource", sub),
                    ("verb", verb),
                    ("dry_run", dry),
                ];
                let n = sum_counter(metrics, "apiserver_request_total", &labels);
                if n > 0.0 {
                    out.insert(format!("{verb} {what}{suffix}"), n);
                }
            }
        }
    }
    out
}

/// `after - before` per key, divided by `per`, without the zeros.
pub fn requests_delta(
    before: &BTreeMap<String, f64>,
    after: &BTreeMap<String, f64>,
    per: f64,
) -> BTreeMap<String, f64> {
    after
        .iter()
        .filter_map(|(k, a)| {
            let d = a - before.get(k).copied().unwrap_or(0.0);
            (d > 0.0).then(|| (k.clone(), round2(d / per)))
        })
        .collect()
}

pub fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// Sums a counter's series whose labels include every `want` pair.
pub fn sum_counter(text: &str, name: &str, want: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (metric, labels) = series.split_once('{').unwrap_or((series, ""));
            if metric != name {
                return None;
            }
            let labels = parse_labels(labels.trim_end_matches('}'));
            want.iter()
                .all(|(k, v)| labels.iter().any(|(lk, lv)| lk == k && lv == v))
                .then(|| value.parse::<f64>().ok())?
        })
        .sum()
}

fn parse_labels(s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = s;
    while let Some((key, after)) = rest.split_once("=\"") {
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, e)) = chars.next() {
                        value.push(e);
                    }
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        out.push((key.trim_start_matches(',').trim().to_owned(), value));
        rest = &after[end..];
    }
    out
}

/// The medians over rounds of `grpc` results (JSON lines carrying a
/// `round`): one object per driver (and Go client limit, and whether the
/// claims were Isolated shares), per_claim and concurrency, with the median
/// and the per-round values of each phase's p50, p99 and the driver's CPU
/// per claim, ordered as first seen.
pub fn round_medians(lines: &str) -> Vec<serde_json::Value> {
    use serde_json::{Value, json};
    type Key = (String, Value, Value, Value, Value);
    let mut groups: Vec<(Key, Vec<Value>)> = Vec::new();
    for line in lines.lines() {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if v.get("round").is_none() || v.get("prepare").is_none() {
            continue;
        }
        let key = (
            v["driver"].as_str().unwrap_or_default().to_owned(),
            v["go_client_qps"].clone(),
            v["per_claim"].clone(),
            v["concurrency"].clone(),
            v["isolated"].clone(),
        );
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, runs)) => runs.push(v),
            None => groups.push((key, vec![v])),
        }
    }
    let per_round = |runs: &[Value], pointer: &str| -> Vec<f64> {
        (runs.iter())
            .filter_map(|r| r.pointer(pointer)?.as_f64())
            .collect()
    };
    let median = |mut xs: Vec<f64>| {
        xs.sort_by(f64::total_cmp);
        match xs.len() {
            0 => None,
            n if n % 2 == 1 => Some(xs[n / 2]),
            n => Some((xs[n / 2 - 1] + xs[n / 2]) / 2.0),
        }
    };
    groups
        .into_iter()
        .map(|((driver, qps, per_claim, concurrency, isolated), runs)| {
            let mut out = json!({
                "medians_of_rounds": runs.len(), "driver": driver,
                "per_claim": per_claim, "concurrency": concurrency,
            });
            if !qps.is_null() {
                out["go_client_qps"] = qps;
            }
            if !isolated.is_null() {
                out["isolated"] = isolated;
            }
            for phase in ["prepare", "unprepare"] {
                let cpu = format!("/driver_cpu_us_per_claim/{phase}");
                for (q, pointer) in [
                    ("p50_ms", format!("/{phase}/p50_ms")),
                    ("p99_ms", format!("/{phase}/p99_ms")),
                    ("driver_cpu_us", cpu),
                ] {
                    let values = per_round(&runs, &pointer);
                    out[phase][q] = json!(median(values.clone()));
                    out[phase][format!("{q}_rounds")] = json!(values);
                }
            }
            out
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_use_the_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 50.0);
        assert_eq!(quantile(&v, 0.99), 99.0);
        assert_eq!(quantile(&[3.0], 0.99), 3.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
    }

    #[test]
    fn a_summary_counts_claims_per_second_of_wall_time() {
        let s = Summary::of(
            &[Duration::from_millis(2), Duration::from_millis(4)],
            2,
            Duration::from_millis(500),
        );
        assert_eq!(s.calls, 2);
        assert_eq!(s.p50_ms, 2.0);
        assert_eq!(s.mean_ms, 3.0);
        assert_eq!(s.claims_per_s, 4.0);
    }

    const KUBELET: &str = r#"# HELP dra_grpc_operations_duration_seconds x
# TYPE dra_grpc_operations_duration_seconds histogram
dra_grpc_operations_duration_seconds_bucket{driver_name="a",grpc_status_code="OK",method_name="/v1.DRAPlugin/NodePrepareResources",le="0.01"} 2
dra_grpc_operations_duration_seconds_bucket{driver_name="a",grpc_status_code="OK",method_name="/v1.DRAPlugin/NodePrepareResources",le="0.02"} 6
dra_grpc_operations_duration_seconds_bucket{driver_name="a",grpc_status_code="OK",method_name="/v1.DRAPlugin/NodePrepareResources",le="+Inf"} 6
dra_grpc_operations_duration_seconds_sum{driver_name="a",grpc_status_code="OK",method_name="/v1.DRAPlugin/NodePrepareResources"} 0.07
dra_grpc_operations_duration_seconds_count{driver_name="a",grpc_status_code="OK",method_name="/v1.DRAPlugin/NodePrepareResources"} 6
dra_grpc_operations_duration_seconds_count{driver_name="b",grpc_status_code="OK",method_name="/v1.DRAPlugin/NodePrepareResources"} 9
apiserver_request_total{code="201",resource="resourceslices",verb="POST"} 3
apiserver_request_total{code="200",resource="resourceslices",verb="PUT"} 2
apiserver_request_total{code="200",resource="resourceslices",verb="LIST"} 7
"#;

    #[test]
    fn a_kubelet_histogram_is_read_for_one_driver_and_method() {
        let h = parse_histogram(
            KUBELET,
            "dra_grpc_operations_duration_seconds",
            &[
                ("driver_name", "a"),
                ("method_name", "/v1.DRAPlugin/NodePrepareResources"),
            ],
        );
        assert_eq!(h.count, 6.0);
        assert!((h.mean() - 0.07 / 6.0).abs() < 1e-12);
        // Rank 3 of 6 lies a quarter into the (0.01, 0.02] bucket.
        assert!((h.quantile(0.5) - 0.0125).abs() < 1e-12);
        let later = Histogram {
            count: 8.0,
            sum: 0.1,
            buckets: vec![(0.01, 3.0), (0.02, 8.0), (f64::INFINITY, 8.0)],
        };
        let d = later.since(&h);
        assert_eq!(d.count, 2.0);
        assert_eq!(d.buckets[0], (0.01, 1.0));
    }

    #[test]
    fn counters_are_summed_over_matching_series() {
        let writes = |verb| sum_counter(KUBELET, "apiserver_request_total", &[("verb", verb)]);
        assert_eq!(writes("POST") + writes("PUT"), 5.0);
        assert_eq!(writes("DELETE"), 0.0);
    }

    #[test]
    fn medians_are_taken_per_driver_and_run_over_rounds() {
        let run = |round: u32, driver: &str, qps: bool, c: u32, p50: f64| {
            let limit = if qps {
                r#""go_client_qps":100000,"#
            } else {
                ""
            };
            let cpu = p50 * 10.0;
            format!(
                r#"{{"round":{round},{limit}"driver":"{driver}","per_claim":1,"concurrency":{c},"prepare":{{"p50_ms":{p50},"p99_ms":9.0}},"unprepare":{{"p50_ms":0.5,"p99_ms":1.0}},"driver_cpu_us_per_claim":{{"prepare":{cpu},"unprepare":null}}}}"#
            )
        };
        let lines = [
            run(1, "go", true, 1, 3.0),
            run(1, "t", false, 1, 2.0),
            r#"{"driver":"t","per_claim":1,"concurrency":1,"prepare":{"p50_ms":99.0}}"#.into(),
            r#"{"round":2,"driver":"t","rss_idle_kib":1}"#.into(),
            run(2, "go", true, 1, 5.0),
            run(2, "t", false, 1, 4.0),
            run(3, "go", true, 1, 1.0),
            run(3, "t", false, 1, 2.5),
            run(3, "t", false, 16, 7.0),
            run(3, "t", false, 16, 60.0)
                .replace("{\"round\":3,", "{\"round\":3,\"isolated\":true,"),
        ]
        .join("\n");
        let m = round_medians(&lines);
        assert_eq!(m.len(), 4, "{m:?}");
        assert_eq!(
            (m[3]["isolated"].clone(), m[3]["prepare"]["p50_ms"].clone()),
            (true.into(), 60.0.into()),
            "Isolated shares are medians of their own"
        );
        assert!(m[2].get("isolated").is_none());
        assert_eq!(m[0]["driver"], "go");
        assert_eq!(m[0]["go_client_qps"], 100000);
        assert_eq!(m[0]["prepare"]["p50_ms"], 3.0);
        assert_eq!(
            m[0]["prepare"]["p50_ms_rounds"],
            serde_json::json!([3.0, 5.0, 1.0])
        );
        assert_eq!(
            m[1]["prepare"]["p50_ms"], 2.5,
            "the unrounded run is left out"
        );
        assert_eq!(m[0]["prepare"]["driver_cpu_us"], 30.0);
        assert_eq!(
            m[0]["unprepare"]["driver_cpu_us"],
            serde_json::Value::Null,
            "no CPU without the driver's pid"
        );
        assert!(m[1].get("go_client_qps").is_none());
        assert_eq!(
            (
                m[2]["concurrency"].clone(),
                m[2]["medians_of_rounds"].clone()
            ),
            (16.into(), 1.into())
        );
        assert_eq!(m[2]["unprepare"]["p99_ms"], 1.0);
    }
}
