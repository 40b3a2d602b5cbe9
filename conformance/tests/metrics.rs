//! The node process's operator view: `/metrics` and `/healthz` on
//! `--metrics-address`, and `tessera status` beside the running process
//! (it must not need the state lock the process holds).

mod plugin_support;

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};
use tessera_conformance::wait_for;

use plugin_support::*;

const GIB: u64 = 1 << 30;

/// `GET path` over HTTP/1.1; (status code, body).
async fn get(address: SocketAddr, path: &str) -> Result<(u16, String)> {
    let request = format!("GET {path} HTTP/1.1\r\nHost: tessera\r\nConnection: close\r\n\r\n");
    let answer = tokio::task::spawn_blocking(move || -> Result<String> {
        let mut stream = std::net::TcpStream::connect(address)?;
        stream.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
        stream.write_all(request.as_bytes())?;
        let mut answer = String::new();
        stream.read_to_string(&mut answer)?;
        Ok(answer)
    })
    .await??;
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .with_context(|| format!("not an HTTP answer: {answer:?}"))?;
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("no status code in {head:?}"))?;
    Ok((code, body.to_owned()))
}

/// The value of the sample `name{labels}` (exactly as written) in a scrape.
fn sample(scrape: &str, series: &str) -> Option<f64> {
    scrape.lines().find_map(|line| {
        let (name, value) = line.rsplit_once(' ')?;
        (name == series).then(|| value.parse().ok())?
    })
}

fn expect(scrape: &str, series: &str, want: f64) -> Result<()> {
    match sample(scrape, series) {
        Some(v) if v == want => Ok(()),
        Some(v) => bail!("{series} is {v}, expected {want}; scrape:\n{scrape}"),
        None => bail!("{series} missing; scrape:\n{scrape}"),
    }
}

/// `tessera status -o json` against the plugin's state directory.
fn status(dirs: &PluginDirs) -> Result<Value> {
    let b = binaries();
    let out = Command::new(&b.tessera)
        .arg("--nvml-library")
        .arg(&b.fake_nvml)
        .args(["status", "-o", "json", "--state-dir"])
        .arg(dirs.state())
        .arg("--boot-id-file")
        .arg(dirs.boot_id())
        .env("TESSERA_FAKE_NVML_TOPOLOGY", topology_path())
        .env("TESSERA_FAKE_NVML_STATE", dirs.nvml_state())
        .env_remove("TESSERA_FAKE_NVML_DRIVER_ROOT")
        .output()?;
    ensure!(
        out.status.success(),
        "tessera status failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

#[tokio::test]
async fn metrics_and_status_follow_a_prepared_claim() -> Result<()> {
    let w = World::new("metrics").await?;
    let mut plugin = PluginProcess::start(&w.dirs, &w.options())?;
    let mut k = register(&w.dirs, &mut plugin, &w.driver).await?;
    let address = plugin.metrics_address().await?;

    // Ready once the first model is built (the chart's probe).
    wait_for("/healthz answering 200", TIMEOUT, || async {
        Ok((get(address, "/healthz").await?.0 == 200).then_some(()))
    })
    .await?;
    let (code, _) = get(address, "/nothing-here").await?;
    ensure!(code == 404, "unknown path answered {code}");

    let shared = share(&w.node, &w.driver, true);
    let gpu_uuid = devices(&w.node, &w.driver)[&shared].gpu_uuid.clone();
    let claim = create_allocated(
        &w.cluster.client(),
        w.ns(),
        &ClaimSpec {
            name: "scraped".into(),
            requests: vec![("share".into(), CLASS.into())],
            results: vec![{
                let mut r = result("share", &w.driver, &w.node, &shared);
                r["shareID"] = json!("7a1e2d3c-4b5a-4978-8a6b-5c4d3e2f1a0b");
                r["consumedCapacity"] = json!({"memory": "4Gi", "cores": "20"});
                r
            }],
            config: vec![],
            spec_config: vec![],
        },
    )
    .await?;
    let uid = claim.metadata.uid.clone().context("uid")?;
    let answer = prepare(&mut k, vec![claim_ref(w.ns(), &claim)]).await?;
    let mine = answer.claims.get(&uid).context("no answer for the claim")?;
    ensure!(mine.error.is_empty(), "prepare failed: {}", mine.error);

    let (code, scrape) = get(address, "/metrics").await?;
    ensure!(code == 200, "/metrics answered {code}: {scrape}");
    expect(&scrape, "tessera_prepare_duration_seconds_count", 1.0)?;
    expect(
        &scrape,
        r#"tessera_claim_operations_total{operation="prepare",result="ok"}"#,
        1.0,
    )?;
    expect(&scrape, "tessera_prepared_claims", 1.0)?;
    let allocated = format!(r#"tessera_gpu_memory_allocated_bytes{{gpu="{gpu_uuid}"}}"#);
    expect(&scrape, &allocated, (4 * GIB) as f64)?;
    ensure!(
        sample(
            &scrape,
            &format!(r#"tessera_gpu_memory_used_bytes{{gpu="{gpu_uuid}"}}"#)
        )
        .is_some(),
        "no NVML used memory for {gpu_uuid}:\n{scrape}"
    );
    ensure!(
        sample(&scrape, r#"tessera_published_devices{kind="share"}"#).is_some_and(|n| n > 0.0),
        "no share devices counted:\n{scrape}"
    );
    ensure!(
        sample(&scrape, "tessera_slice_reconciles_total").is_some_and(|n| n >= 1.0),
        "no reconcile counted:\n{scrape}"
    );

    // `tessera status` beside the running node process (which holds the
    // state lock).
    let report = status(&w.dirs)?;
    let gpu = report["gpus"]
        .as_array()
        .context("gpus")?
        .iter()
        .find(|g| g["uuid"] == gpu_uuid.as_str())
        .with_context(|| format!("{gpu_uuid} not in {report:#}"))?;
    ensure!(
        gpu["memoryAllocatedBytes"] == json!(4 * GIB),
        "allocated memory: {gpu:#}"
    );
    ensure!(gpu["memoryUsedBytes"].is_u64(), "used memory: {gpu:#}");
    ensure!(gpu["migMode"].is_string(), "MIG mode: {gpu:#}");
    let claims = gpu["claims"].as_array().context("claims")?;
    ensure!(claims.len() == 1, "claims on {gpu_uuid}: {claims:#?}");
    let c = &claims[0];
    ensure!(
        c["namespace"] == w.ns() && c["name"] == "scraped" && c["uid"] == uid.as_str(),
        "{c:#}"
    );
    ensure!(
        c["device"] == shared.as_str() && c["kind"] == "share",
        "{c:#}"
    );
    ensure!(
        c["state"] == "Completed" && c["memoryBytes"] == json!(4 * GIB),
        "{c:#}"
    );

    // Unprepare: the latency is recorded and the memory is released.
    let answer = unprepare(&mut k, vec![claim_ref(w.ns(), &claim)]).await?;
    let mine = answer.claims.get(&uid).context("no unprepare answer")?;
    ensure!(mine.error.is_empty(), "unprepare failed: {}", mine.error);
    let (_, scrape) = get(address, "/metrics").await?;
    expect(&scrape, "tessera_unprepare_duration_seconds_count", 1.0)?;
    expect(&scrape, "tessera_prepared_claims", 0.0)?;
    expect(&scrape, &allocated, 0.0)?;
    let report = status(&w.dirs)?;
    ensure!(
        report["gpus"]
            .as_array()
            .context("gpus")?
            .iter()
            .all(|g| g["claims"].as_array().is_some_and(|c| c.is_empty())),
        "claims left after unprepare: {report:#}"
    );

    plugin.terminate().await?;
    Ok(())
}

#[tokio::test]
async fn metrics_address_off_serves_nothing() -> Result<()> {
    let w = World::new("metrics-off").await?;
    let mut opts = w.options();
    opts.args = vec!["--metrics-address".into(), "off".into()];
    let mut plugin = PluginProcess::start(&w.dirs, &opts)?;
    register(&w.dirs, &mut plugin, &w.driver).await?;
    let log = std::fs::read_to_string(&plugin.log)?;
    ensure!(!log.contains("serving metrics on"), "{log}");
    plugin.terminate().await?;
    Ok(())
}

/// The authenticated endpoint answers only whom the API server allows:
/// 401 without a token or with one it does not accept, 403 to an account
/// without `get` on /metrics (saying how to grant it), the metrics to one
/// bound to a ClusterRole that allows it. The plain endpoint is unchanged.
#[tokio::test]
async fn the_secure_endpoint_serves_only_whom_the_api_server_allows() -> Result<()> {
    use tessera_conformance::suite::metrics_service::{Readers, get as get_tls};
    let w = World::new("metrics-secure").await?;
    let mut opts = w.options();
    opts.args = vec!["--metrics-secure-address".into(), "127.0.0.1:0".into()];
    let mut plugin = PluginProcess::start(&w.dirs, &opts)?;
    let url = format!("https://{}/metrics", plugin.secure_metrics_address().await?);
    let plain = plugin.metrics_address().await?;
    let readers = Readers::make(&w.cluster.client(), w.ns(), "/metrics").await?;
    let checked = async {
        let (code, body) = get_tls(&url, None).await?;
        ensure!(
            code == 401 && body.contains("bearer token"),
            "no token: {code} {body}"
        );
        let (code, body) = get_tls(&url, Some("not-a-token")).await?;
        ensure!(code == 401, "a token the API server refuses: {code} {body}");
        let (code, body) = get_tls(&url, Some(&readers.stranger)).await?;
        ensure!(
            code == 403 && body.contains("metrics-stranger") && body.contains("nonResourceURLs"),
            "an account without access: {code} {body}"
        );
        let (code, body) = get_tls(&url, Some(&readers.allowed)).await?;
        ensure!(
            code == 200 && body.contains("tessera_prepared_claims"),
            "the reader: {code} {body}"
        );
        // The same reader again: answered from the kept verdict.
        let (code, _) = get_tls(&url, Some(&readers.allowed)).await?;
        ensure!(code == 200, "the reader's second scrape: {code}");
        let (code, _) = get(plain, "/metrics").await?;
        ensure!(code == 200, "the plain endpoint answered {code}");
        Ok(())
    }
    .await;
    readers.remove().await;
    checked?;
    plugin.terminate().await?;
    Ok(())
}
