//! `tessera plugin` against the real API server, driven over its sockets
//! as the kubelet drives it: lifecycle, idempotence, claim status, bad
//! inputs, concurrency. Allocations are written directly into the claims'
//! status (see `plugin_support`).

#![allow(clippy::unwrap_used)] // test code: a panic is how it reports a failure

mod plugin_support;

use std::os::unix::fs::MetadataExt;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use serde_json::{Value, json};
use tessera_conformance::wait_for;

use plugin_support::*;

/// What prepare answers a device of request `request` with: the claim's
/// CDI device and the driver's `cuda` one.
fn cdi_ids(request: &str, uid: &str) -> Vec<String> {
    vec![
        format!("gpu.tessera.dev/claim={request}_{uid}"),
        "gpu.tessera.dev/driver=cuda".to_owned(),
    ]
}

async fn status_devices(api: &Api<ResourceClaim>, name: &str) -> Result<Vec<Value>> {
    let claim = api.get(name).await?;
    let devices = claim
        .status
        .and_then(|s| s.devices)
        .unwrap_or_default()
        .into_iter()
        .map(|d| serde_json::to_value(d).unwrap())
        .collect();
    Ok(devices)
}

#[tokio::test]
async fn prepare_unprepare_lifecycle() -> Result<()> {
    let w = World::new("plugin-life").await?;
    let mut plugin = PluginProcess::start(&w.dirs, &w.options())?;
    let mut k = register(&w.dirs, &mut plugin, &w.driver).await?;

    // Registration: what the kubelet's plugin manager reads.
    ensure!(k.info.r#type == "DRAPlugin", "{:?}", k.info);
    ensure!(k.info.name == w.driver);
    ensure!(
        k.info.supported_versions
            == [
                "v1.DRAPlugin",
                "v1beta1.DRAPlugin",
                "v1alpha1.DRAResourceHealth"
            ],
        "{:?}",
        k.info.supported_versions
    );
    let endpoint = std::path::PathBuf::from(&k.info.endpoint);
    ensure!(
        endpoint.parent() == Some(w.dirs.plugins().join(&w.driver).as_path()),
        "endpoint {endpoint:?}"
    );
    ensure!(std::fs::metadata(&endpoint)?.mode() & 0o777 == 0o600);
    ensure!(std::fs::metadata(endpoint.parent().unwrap())?.mode() & 0o777 == 0o700);

    let gpu = whole_gpu(&w.node, &w.driver);
    let (mig, mig_uuid) = existing_mig(&w.node, &w.driver);
    let shared = share(&w.node, &w.driver, true);
    let claims: Api<ResourceClaim> = w.namespace.api();
    let claim = create_allocated(
        &w.cluster.client(),
        w.ns(),
        &ClaimSpec {
            name: "life".into(),
            requests: vec![
                ("gpu".into(), CLASS.into()),
                ("mig".into(), CLASS.into()),
                ("share".into(), CLASS.into()),
            ],
            results: vec![
                result("gpu", &w.driver, &w.node, &gpu),
                result("mig", &w.driver, &w.node, &mig),
                {
                    let mut r = result("share", &w.driver, &w.node, &shared);
                    r["shareID"] = json!("6f1e2d3c-4b5a-4978-8a6b-5c4d3e2f1a0b");
                    r["consumedCapacity"] = json!({"memory": "4Gi", "cores": "20"});
                    r
                },
            ],
            config: vec![json!({
                "source": "FromClass",
                "requests": ["gpu"],
                "opaque": { "driver": w.driver, "parameters": {
                    "apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuConfig",
                    "sharing": { "strategy": "None" } } },
            })],
            spec_config: vec![],
        },
    )
    .await?;
    let uid = claim.metadata.uid.clone().context("uid")?;
    let inv = inventory();
    let gpu_ref = &devices(&w.node, &w.driver)[&gpu];
    let gpu_info = inv
        .gpus
        .iter()
        .find(|g| g.uuid == gpu_ref.gpu_uuid)
        .unwrap();
    let mig_gpu = inv
        .gpus
        .iter()
        .find(|g| g.mig.instances().iter().any(|i| i.uuid == mig_uuid))
        .unwrap();
    let mig_inst = mig_gpu
        .mig
        .instances()
        .iter()
        .find(|i| i.uuid == mig_uuid)
        .unwrap();

    let answer = prepare(&mut k, vec![claim_ref(w.ns(), &claim)]).await?;
    let mine = answer.claims.get(&uid).context("no answer for the claim")?;
    ensure!(mine.error.is_empty(), "prepare failed: {}", mine.error);
    let by_device: std::collections::BTreeMap<&str, &Vec<String>> = mine
        .devices
        .iter()
        .map(|d| (d.device_name.as_str(), &d.cdi_device_ids))
        .collect();
    ensure!(by_device.len() == 3, "{:?}", mine.devices);
    ensure!(by_device[gpu.as_str()] == &cdi_ids("gpu", &uid));
    ensure!(by_device[mig.as_str()] == &cdi_ids("mig", &uid));
    ensure!(by_device[shared.as_str()] == &cdi_ids("share", &uid));
    ensure!(mine.devices.iter().all(|d| d.pool_name == w.node));

    // The CDI spec: one device per request, each with exactly its GPUs.
    let spec = w.dirs.spec(&uid).context("no CDI spec written")?;
    ensure!(spec["kind"] == "gpu.tessera.dev/claim", "{spec}");
    ensure!(
        spec["cdiVersion"] == "0.5.0",
        "hostPath needs 0.5.0: {spec}"
    );
    let dev = |name: &str| -> Value {
        spec["devices"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["name"] == format!("{name}_{uid}"))
            .cloned()
            .unwrap_or(Value::Null)
    };
    let env = |d: &Value| -> Vec<String> {
        d["containerEdits"]["env"]
            .as_array()
            .map(|a| a.iter().map(|v| v.as_str().unwrap().to_owned()).collect())
            .unwrap_or_default()
    };
    let nodes = |d: &Value| -> Vec<String> {
        d["containerEdits"]["deviceNodes"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|v| v["path"].as_str().unwrap().to_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    let g = dev("gpu");
    ensure!(
        env(&g).contains(&format!("NVIDIA_VISIBLE_DEVICES={}", gpu_info.uuid))
            && env(&g).contains(&format!("CUDA_VISIBLE_DEVICES={}", gpu_info.uuid)),
        "{g}"
    );
    ensure!(
        nodes(&g) == vec![format!("/dev/nvidia{}", gpu_info.minor)],
        "{g}"
    );
    ensure!(
        g["containerEdits"]["deviceNodes"][0]["hostPath"]
            == json!(
                w.dirs
                    .driver_root()
                    .join(format!("dev/nvidia{}", gpu_info.minor))
            ),
        "{g}"
    );
    let m = dev("mig");
    let (gi_cap, ci_cap) = mig_cap_minors(mig_gpu.minor, mig_inst.gpu_instance_id);
    ensure!(
        nodes(&m)
            == vec![
                format!("/dev/nvidia{}", mig_gpu.minor),
                format!("/dev/nvidia-caps/nvidia-cap{gi_cap}"),
                format!("/dev/nvidia-caps/nvidia-cap{ci_cap}"),
            ],
        "{m}"
    );
    ensure!(
        env(&m).contains(&format!("NVIDIA_VISIBLE_DEVICES={mig_uuid}")),
        "{m}"
    );
    let s = dev("share");
    ensure!(
        !env(&s).iter().any(|e| e.starts_with("CUDA_MPS")),
        "Shared gets no MPS: {s}"
    );
    // What every container needs is the driver's spec's, not the claim's.
    ensure!(spec.get("containerEdits").is_none(), "{spec}");
    let driver = w.dirs.driver_spec().context("no driver CDI spec")?;
    ensure!(driver["kind"] == "gpu.tessera.dev/driver", "{driver}");
    let cuda = driver["devices"]
        .as_array()
        .and_then(|d| d.iter().find(|d| d["name"] == "cuda"))
        .context("no cuda device in the driver spec")?;
    let common: Vec<&str> = cuda["containerEdits"]["deviceNodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["path"].as_str().unwrap())
        .collect();
    ensure!(
        common == ["/dev/nvidiactl", "/dev/nvidia-uvm"],
        "{common:?}"
    );

    // Checkpoint entry.
    let cp = w.dirs.checkpoint();
    ensure!(cp[&uid]["state"] == "Completed", "{:?}", cp.get(&uid));
    ensure!(cp[&uid]["name"] == "life");

    // Claim status: which GPU the claim got.
    let status = wait_for("status.devices written", TIMEOUT, || async {
        let d = status_devices(&claims, "life").await?;
        Ok((d.len() == 3).then_some(d))
    })
    .await?;
    let entry = |device: &str| {
        status
            .iter()
            .find(|d| d["device"] == device)
            .unwrap()
            .clone()
    };
    ensure!(entry(&gpu)["driver"] == json!(w.driver));
    ensure!(
        entry(&gpu)["data"]["gpuUUID"] == json!(gpu_info.uuid),
        "{status:?}"
    );
    ensure!(entry(&gpu)["data"]["sharing"] == "None", "{status:?}");
    ensure!(
        entry(&mig)["data"]["migUUID"] == json!(mig_uuid),
        "{status:?}"
    );
    ensure!(
        entry(&mig)["data"]["gpuUUID"] == json!(mig_gpu.uuid),
        "{status:?}"
    );
    let sh = entry(&shared);
    ensure!(
        sh["shareID"] == "6f1e2d3c-4b5a-4978-8a6b-5c4d3e2f1a0b",
        "{sh}"
    );
    ensure!(sh["data"]["isolationLevel"] == "Shared", "{sh}");
    ensure!(
        sh["data"]["consumed"]["memoryBytes"] == json!(4u64 << 30),
        "{sh}"
    );
    ensure!(sh["data"]["consumed"]["coresPercent"] == 20, "{sh}");

    // Idempotent: the same answer again, the same spec file.
    let spec_bytes = std::fs::read(
        w.dirs
            .cdi()
            .join(format!("gpu.tessera.dev-claim_{uid}.json")),
    )?;
    let again = prepare(&mut k, vec![claim_ref(w.ns(), &claim)]).await?;
    ensure!(again.claims[&uid] == *mine, "second prepare differs");
    ensure!(
        std::fs::read(
            w.dirs
                .cdi()
                .join(format!("gpu.tessera.dev-claim_{uid}.json"))
        )? == spec_bytes
    );

    // The v1beta1 service (kubelets before 1.34) gives the same answer.
    {
        use tessera_api::kubelet::dra_v1beta1 as beta;
        let mut client = beta::dra_plugin_client::DraPluginClient::new(connect(&endpoint).await?);
        let b = client
            .node_prepare_resources(beta::NodePrepareResourcesRequest {
                claims: vec![beta::Claim {
                    namespace: w.ns().into(),
                    uid: uid.clone(),
                    name: "life".into(),
                }],
            })
            .await?
            .into_inner();
        let b = &b.claims[&uid];
        ensure!(b.error.is_empty(), "{}", b.error);
        let same = b.devices.len() == mine.devices.len()
            && b.devices.iter().zip(&mine.devices).all(|(x, y)| {
                x.device_name == y.device_name
                    && x.pool_name == y.pool_name
                    && x.request_names == y.request_names
                    && x.cdi_device_ids == y.cdi_device_ids
            });
        ensure!(same, "v1beta1 answer differs: {:?}", b.devices);
    }

    // Unprepare: spec, entry and our status entries gone; twice is fine.
    let un = unprepare(&mut k, vec![claim_ref(w.ns(), &claim)]).await?;
    ensure!(un.claims[&uid].error.is_empty(), "{:?}", un.claims[&uid]);
    w.dirs.claim_files_removed(&uid).await?;
    ensure!(!w.dirs.checkpoint().contains_key(&uid), "entry left behind");
    wait_for("status.devices cleared", TIMEOUT, || async {
        Ok(status_devices(&claims, "life")
            .await?
            .is_empty()
            .then_some(()))
    })
    .await?;
    let un = unprepare(&mut k, vec![claim_ref(w.ns(), &claim)]).await?;
    ensure!(un.claims[&uid].error.is_empty());

    // Graceful shutdown removes both sockets.
    let reg = w.dirs.registry();
    let exit = plugin.terminate().await?;
    ensure!(exit.success(), "exit {exit:?}");
    ensure!(!endpoint.exists(), "DRA socket left behind");
    ensure!(
        std::fs::read_dir(&reg)?.next().is_none(),
        "registration socket left behind"
    );
    w.namespace.delete().await
}

#[tokio::test]
async fn bad_claims_fail_alone() -> Result<()> {
    let w = World::new("plugin-bad").await?;
    let mut plugin = PluginProcess::start(&w.dirs, &w.options())?;
    let mut k = register(&w.dirs, &mut plugin, &w.driver).await?;
    let client = w.cluster.client();
    let gpu = whole_gpu(&w.node, &w.driver);
    let shared = share(&w.node, &w.driver, true);
    let ok_share = |name: &str| ClaimSpec {
        name: name.into(),
        requests: vec![("share".into(), CLASS.into())],
        results: vec![{
            let mut r = result("share", &w.driver, &w.node, &shared);
            r["consumedCapacity"] = json!({"memory": "1Gi", "cores": "10"});
            r
        }],
        config: vec![],
        spec_config: vec![],
    };
    let gpu_with_config = |name: &str, parameters: Value| {
        let config = json!({ "requests": ["gpu"], "opaque": { "driver": w.driver, "parameters": parameters } });
        let mut with_source = config.clone();
        with_source["source"] = json!("FromClaim");
        ClaimSpec {
            name: name.into(),
            requests: vec![("gpu".into(), CLASS.into())],
            results: vec![result("gpu", &w.driver, &w.node, &gpu)],
            config: vec![with_source],
            spec_config: vec![config],
        }
    };
    let api_version = "gpu.tessera.dev/v1alpha1";

    let good = create_allocated(&client, w.ns(), &ok_share("good")).await?;
    let malformed = create_allocated(
        &client,
        w.ns(),
        &gpu_with_config(
            "malformed",
            json!({"apiVersion": api_version, "kind": "GpuConfig", "sharing": "yes"}),
        ),
    )
    .await?;
    let unknown = create_allocated(
        &client,
        w.ns(),
        &gpu_with_config(
            "unknown-field",
            json!({"apiVersion": api_version, "kind": "GpuConfig", "sharing": {"stratgy": "MPS"}}),
        ),
    )
    .await?;
    let wrong_kind = create_allocated(
        &client,
        w.ns(),
        &gpu_with_config(
            "wrong-kind",
            json!({"apiVersion": api_version, "kind": "MigConfig"}),
        ),
    )
    .await?;
    let mut other_node = ok_share("other-node");
    other_node.results[0]["pool"] = json!("some-other-node");
    let other_node = create_allocated(&client, w.ns(), &other_node).await?;
    let mut other_driver = ok_share("other-driver");
    other_driver.results = vec![result("share", "net.example.com", &w.node, "eth0")];
    let other_driver = create_allocated(&client, w.ns(), &other_driver).await?;
    let unallocated: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": "unallocated"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": CLASS}}]}},
    }))?;
    let unallocated = w
        .namespace
        .api::<ResourceClaim>()
        .create(&Default::default(), &unallocated)
        .await?;

    let mut uid_mismatch = claim_ref(w.ns(), &good);
    uid_mismatch.uid = "0a0b0c0d-1111-4222-8333-444455556666".into();
    let traversal_uid = tessera_api::kubelet::dra_v1::Claim {
        namespace: w.ns().into(),
        name: "good".into(),
        uid: "../../../../etc/passwd".into(),
    };
    let traversal_name = tessera_api::kubelet::dra_v1::Claim {
        namespace: w.ns().into(),
        name: "../../secrets/x".into(),
        uid: "0a0b0c0d-1111-4222-8333-777788889999".into(),
    };

    let mut request = vec![claim_ref(w.ns(), &good)];
    let cases: Vec<(tessera_api::kubelet::dra_v1::Claim, &[&str])> = vec![
        (
            claim_ref(w.ns(), &malformed),
            &["malformed", "sharing", "fix:"],
        ),
        (
            claim_ref(w.ns(), &unknown),
            &["unknown-field", "stratgy", "fix:"],
        ),
        (
            claim_ref(w.ns(), &wrong_kind),
            &["wrong-kind", "MigConfig", "fix:"],
        ),
        (
            claim_ref(w.ns(), &other_node),
            &["other-node", "another node", "fix:"],
        ),
        (
            claim_ref(w.ns(), &other_driver),
            &[
                "other-driver",
                "no device of driver gpu.tessera.dev",
                "fix:",
            ],
        ),
        (
            claim_ref(w.ns(), &unallocated),
            &["unallocated", "not allocated", "fix:"],
        ),
        (uid_mismatch.clone(), &["metadata.uid", "fix:"]),
        (traversal_uid.clone(), &["not a Kubernetes UID"]),
        (
            traversal_name.clone(),
            &["not a valid ResourceClaim name", "fix:"],
        ),
    ];
    request.extend(cases.iter().map(|(c, _)| c.clone()));
    let answer = prepare(&mut k, request).await?;
    ensure!(
        answer.claims.len() == cases.len() + 1,
        "every claim answered: {:?}",
        answer.claims.keys()
    );
    let good_uid = good.metadata.uid.clone().unwrap();
    ensure!(
        answer.claims[&good_uid].error.is_empty(),
        "{}",
        answer.claims[&good_uid].error
    );
    for (claim, needles) in &cases {
        let got = answer
            .claims
            .get(&claim.uid)
            .with_context(|| format!("no answer for {claim:?}"))?;
        ensure!(got.devices.is_empty(), "{claim:?} got devices");
        for needle in *needles {
            ensure!(
                got.error.contains(needle),
                "error for {} lacks {needle:?}: {}",
                claim.name,
                got.error
            );
        }
        ensure!(
            got.error.contains(&format!("claim {}/", claim.namespace)),
            "error names the claim: {}",
            got.error
        );
    }
    // Only the good claim left files behind.
    ensure!(
        w.dirs.cdi_files() == vec![format!("gpu.tessera.dev-claim_{good_uid}.json")],
        "{:?}",
        w.dirs.cdi_files()
    );
    let cp = w.dirs.checkpoint();
    ensure!(cp.keys().collect::<Vec<_>>() == vec![&good_uid], "{cp:?}");
    ensure!(!w.dirs.root.path().parent().unwrap().join("etc").exists());

    // An unreachable API server is a per-claim error too, and files stay.
    drop(k);
    let exit = plugin.terminate().await?;
    ensure!(exit.success());
    let kubeconfig = w.dirs.path("unreachable.kubeconfig");
    let text = std::fs::read_to_string(w.cluster.kubeconfig())?;
    let server_line = text
        .lines()
        .find(|l| l.trim_start().starts_with("server:"))
        .context("kubeconfig has no server")?;
    std::fs::write(
        &kubeconfig,
        text.replace(server_line, "    server: https://127.0.0.1:1"),
    )?;
    let mut options = w.options();
    options.kubeconfig = kubeconfig;
    let mut plugin = PluginProcess::start(&w.dirs, &options)?;
    let mut k = register(&w.dirs, &mut plugin, &w.driver).await?;
    let answer = prepare(
        &mut k,
        vec![claim_ref(w.ns(), &good), claim_ref(w.ns(), &malformed)],
    )
    .await?;
    // The prepared claim answers from the checkpoint; the other cannot be read.
    ensure!(
        answer.claims[&good_uid].error.is_empty(),
        "{}",
        answer.claims[&good_uid].error
    );
    let err = &answer.claims[malformed.metadata.uid.as_ref().unwrap()].error;
    ensure!(
        err.contains("cannot read the ResourceClaim") && err.contains("fix:"),
        "{err}"
    );
    ensure!(w.dirs.cdi_files().len() == 1);
    let un = unprepare(&mut k, vec![claim_ref(w.ns(), &good)]).await?;
    ensure!(
        un.claims[&good_uid].error.is_empty(),
        "{:?}",
        un.claims[&good_uid]
    );
    w.dirs.unprepared_files_removed().await?;
    w.namespace.delete().await
}

#[tokio::test]
async fn many_claims_in_parallel() -> Result<()> {
    const CLAIMS: usize = 24;
    let w = World::new("plugin-par").await?;
    let mut plugin = PluginProcess::start(&w.dirs, &w.options())?;
    let k = register(&w.dirs, &mut plugin, &w.driver).await?;
    let shared = share(&w.node, &w.driver, true);
    let mut refs = Vec::new();
    for i in 0..CLAIMS {
        let mut r = result("share", &w.driver, &w.node, &shared);
        r["shareID"] = json!(format!("00000000-0000-4000-8000-{i:012}"));
        r["consumedCapacity"] = json!({"memory": "256Mi", "cores": "1"});
        let claim = create_allocated(
            &w.cluster.client(),
            w.ns(),
            &ClaimSpec {
                name: format!("c{i}"),
                requests: vec![("share".into(), CLASS.into())],
                results: vec![r],
                config: vec![],
                spec_config: vec![],
            },
        )
        .await?;
        refs.push(claim_ref(w.ns(), &claim));
    }
    // Six concurrent kubelet calls of 8 claims each; every claim is in two
    // calls, so the same claim is prepared concurrently too.
    let mut calls = Vec::new();
    for c in 0..6 {
        let batch: Vec<_> = (0..8).map(|j| refs[(c * 4 + j) % CLAIMS].clone()).collect();
        let mut dra = k.dra.clone();
        calls.push(tokio::spawn(async move {
            dra.node_prepare_resources(tessera_api::kubelet::dra_v1::NodePrepareResourcesRequest {
                claims: batch,
            })
            .await
            .map(|r| r.into_inner())
        }));
    }
    let mut answers: std::collections::BTreeMap<String, Vec<tessera_api::kubelet::dra_v1::Device>> =
        Default::default();
    for call in calls {
        for (uid, a) in call.await??.claims {
            ensure!(a.error.is_empty(), "{uid}: {}", a.error);
            if let Some(previous) = answers.insert(uid.clone(), a.devices.clone()) {
                ensure!(previous == a.devices, "{uid}: two different answers");
            }
        }
    }
    ensure!(answers.len() == CLAIMS, "{} claims answered", answers.len());
    ensure!(w.dirs.cdi_files().len() == CLAIMS);
    let cp = w.dirs.checkpoint();
    ensure!(cp.len() == CLAIMS && cp.values().all(|e| e["state"] == "Completed"));

    let mut calls = Vec::new();
    for chunk in refs.chunks(6) {
        let mut dra = k.dra.clone();
        let claims = chunk.to_vec();
        calls.push(tokio::spawn(async move {
            dra.node_unprepare_resources(
                tessera_api::kubelet::dra_v1::NodeUnprepareResourcesRequest { claims },
            )
            .await
            .map(|r| r.into_inner())
        }));
    }
    for call in calls {
        for (uid, a) in call.await??.claims {
            ensure!(a.error.is_empty(), "{uid}: {}", a.error);
        }
    }
    // Answered: every record is gone or retired (`Unpreparing`, for
    // start-up recovery to finish should the process die now).
    let left = w.dirs.checkpoint();
    ensure!(
        left.values().all(|e| e["state"] == "Unpreparing"),
        "{left:?}"
    );
    plugin.check_running()?;
    // Stopped at once: the specs and records still waiting to go go
    // before it exits.
    ensure!(plugin.terminate().await?.success());
    ensure!(w.dirs.cdi_files().is_empty(), "{:?}", w.dirs.cdi_files());
    ensure!(w.dirs.checkpoint().is_empty(), "{:?}", w.dirs.checkpoint());
    w.namespace.delete().await
}

/// The message of the CheckpointQuarantined Event on the node, once there.
async fn quarantine_event(w: &World) -> Result<String> {
    use k8s_openapi::api::core::v1::Event;
    let events: Api<Event> = Api::namespaced(w.cluster.client(), "default");
    let event = wait_for("CheckpointQuarantined event on the Node", TIMEOUT, || {
        let events = events.clone();
        async move {
            let list = events.list(&Default::default()).await?;
            Ok(list.items.into_iter().find(|e| {
                e.reason.as_deref() == Some("CheckpointQuarantined")
                    && e.involved_object.kind.as_deref() == Some("Node")
                    && e.involved_object.name.as_deref() == Some(w.node.as_str())
            }))
        }
    })
    .await?;
    Ok(event.message.unwrap_or_default())
}

/// A claim `name` allocated one share (1Gi, 10 %) of a GPU of the node:
/// Shared or Isolated.
async fn share_claim(w: &World, name: &str, shared: bool) -> Result<ResourceClaim> {
    let device = share(&w.node, &w.driver, shared);
    let mut r = result("share", &w.driver, &w.node, &device);
    r["shareID"] = json!("00000000-0000-4000-8000-000000000001");
    r["consumedCapacity"] = json!({"memory": "1Gi", "cores": "10"});
    create_allocated(
        &w.cluster.client(),
        w.ns(),
        &ClaimSpec {
            name: name.into(),
            requests: vec![("share".into(), CLASS.into())],
            results: vec![r],
            config: vec![],
            spec_config: vec![],
        },
    )
    .await
}

#[tokio::test]
async fn corrupted_checkpoint_is_reported_and_a_reboot_forgets() -> Result<()> {
    let w = World::new("plugin-cp").await?;
    let mut plugin = PluginProcess::start(&w.dirs, &w.options())?;
    let mut k = register(&w.dirs, &mut plugin, &w.driver).await?;
    let claim = share_claim(&w, "kept", true).await?;
    let uid = claim.metadata.uid.clone().unwrap();
    let first = prepare(&mut k, vec![claim_ref(w.ns(), &claim)]).await?;
    ensure!(
        first.claims[&uid].error.is_empty(),
        "{}",
        first.claims[&uid].error
    );
    drop(k);
    ensure!(plugin.terminate().await?.success());

    // Flip a byte inside the claim's record: valid JSON, bad checksum.
    let path = w.dirs.records().join(format!("{uid}.json"));
    let text = std::fs::read_to_string(&path)?;
    std::fs::write(&path, text.replacen("Completed", "Completes", 1))?;
    let mut plugin = PluginProcess::start(&w.dirs, &w.options())?;
    let mut k = register(&w.dirs, &mut plugin, &w.driver).await?;
    let message = quarantine_event(&w).await?;
    ensure!(
        message.contains("checksum mismatch") && message.contains("moved to"),
        "{message}"
    );
    ensure!(
        std::fs::read_dir(w.dirs.records())?
            .filter_map(|e| e.ok())
            .any(|e| e
                .file_name()
                .to_string_lossy()
                .starts_with(&format!("{uid}.json.corrupt-"))),
        "quarantined file kept for inspection"
    );
    // The running Pod's spec is not treated as an orphan.
    ensure!(
        w.dirs.spec(&uid).is_some(),
        "spec of a possibly running Pod was deleted"
    );
    // The kubelet's retry prepares the claim again, with the same answer.
    let again = prepare(&mut k, vec![claim_ref(w.ns(), &claim)]).await?;
    ensure!(
        again.claims[&uid] == first.claims[&uid],
        "different answer after quarantine"
    );
    // Its status entries land in the background; the ledger says so.
    let claims: Api<ResourceClaim> = Api::namespaced(w.cluster.client(), w.ns());
    wait_for("status.devices written", TIMEOUT, || async {
        Ok((status_devices(&claims, "kept").await?.len() == 1).then_some(()))
    })
    .await?;
    let ledger = w.dirs.state().join("claim-status.jsonl");
    wait_for("the claim in the status ledger", TIMEOUT, || async {
        Ok(ledger_names(&ledger, &uid).then_some(()))
    })
    .await?;
    drop(k);
    ensure!(plugin.terminate().await?.success());

    // A reboot (new boot id): nothing of the old boot survives, and the
    // claim's status entries (it is no longer prepared here) are removed.
    std::fs::write(w.dirs.boot_id(), "boot-2\n")?;
    let mut plugin = PluginProcess::start(&w.dirs, &w.options())?;
    let _k = register(&w.dirs, &mut plugin, &w.driver).await?;
    ensure!(
        w.dirs.checkpoint().is_empty(),
        "previous boot's entries kept"
    );
    ensure!(w.dirs.cdi_files().is_empty(), "{:?}", w.dirs.cdi_files());
    wait_for(
        "status.devices of the claim no longer prepared removed",
        TIMEOUT,
        || async {
            Ok(status_devices(&claims, "kept")
                .await?
                .is_empty()
                .then_some(()))
        },
    )
    .await?;
    wait_for("its removal in the status ledger", TIMEOUT, || async {
        Ok((!ledger_names(&ledger, &uid)).then_some(()))
    })
    .await?;
    w.namespace.delete().await
}

/// Whether the status ledger's last line about `uid` says its entries are
/// written (`{"written":{"uid":..}}`) rather than removed.
fn ledger_names(ledger: &std::path::Path, uid: &str) -> bool {
    let text = std::fs::read_to_string(ledger).unwrap_or_default();
    let mut named = false;
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if v["written"]["uid"] == uid {
            named = true;
        } else if v["removed"]["uid"] == uid {
            named = false;
        }
    }
    named
}

/// An unreadable record does not cost a running workload its isolation: the
/// Isolated claim's MPS daemon (and spec) outlive the quarantine and later
/// restarts, until the kubelet unprepares the claim; then they go.
#[tokio::test]
async fn a_lost_record_keeps_what_its_claim_uses_until_unprepare() -> Result<()> {
    let w = World::new("plugin-lost").await?;
    let outcome = lost_record_keeps(&w).await;
    if outcome.is_err() {
        eprintln!(
            "plugin log:\n{}",
            std::fs::read_to_string(w.dirs.path("plugin.log")).unwrap_or_default()
        );
    }
    outcome?;
    w.namespace.delete().await
}

async fn lost_record_keeps(w: &World) -> Result<()> {
    let mut plugin = PluginProcess::start(&w.dirs, &w.options())?;
    let mut k = register(&w.dirs, &mut plugin, &w.driver).await?;
    let claim = share_claim(w, "lost", false).await?;
    let uid = claim.metadata.uid.clone().unwrap();
    let first = prepare(&mut k, vec![claim_ref(w.ns(), &claim)]).await?;
    ensure!(
        first.claims[&uid].error.is_empty(),
        "{}",
        first.claims[&uid].error
    );
    let daemons = w.dirs.mps_daemons();
    ensure!(daemons.len() == 1, "one daemon for the claim: {daemons:?}");
    drop(k);
    ensure!(plugin.terminate().await?.success());

    // Its record becomes unreadable (valid JSON, bad checksum).
    let path = w.dirs.records().join(format!("{uid}.json"));
    let text = std::fs::read_to_string(&path)?;
    std::fs::write(&path, text.replacen("Completed", "Completes", 1))?;
    // Two starts: the one that moves the record aside, and a later one
    // that only finds it moved aside.
    for start in 0..2 {
        let mut plugin = PluginProcess::start(&w.dirs, &w.options())?;
        let _k = register(&w.dirs, &mut plugin, &w.driver).await?;
        ensure!(
            w.dirs.mps_daemons() == daemons,
            "start {start}: the lost claim's daemon {daemons:?} was stopped ({:?} now)",
            w.dirs.mps_daemons()
        );
        ensure!(
            w.dirs.spec(&uid).is_some(),
            "start {start}: the lost claim's spec was deleted"
        );
        drop(_k);
        ensure!(plugin.terminate().await?.success());
    }
    let message = quarantine_event(w).await?;
    ensure!(
        message.contains("MPS daemons") && message.contains("until the kubelet unprepares"),
        "{message}"
    );

    // The kubelet unprepares it: its daemon and spec go.
    let mut plugin = PluginProcess::start(&w.dirs, &w.options())?;
    let mut k = register(&w.dirs, &mut plugin, &w.driver).await?;
    let answer = unprepare(&mut k, vec![claim_ref(w.ns(), &claim)]).await?;
    ensure!(
        answer.claims[&uid].error.is_empty(),
        "{}",
        answer.claims[&uid].error
    );
    wait_for("the lost claim's daemon to stop", TIMEOUT, || async {
        Ok(w.dirs.mps_daemons().is_empty().then_some(()))
    })
    .await?;
    w.dirs.claim_files_removed(&uid).await?;
    plugin.check_running()
}
