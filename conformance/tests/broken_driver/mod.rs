//! Broken drivers for proving that `tessera-conformance` catches them.
//!
//! Each is Tessera with one thing wrong, built the way such a bug would
//! reach a cluster:
//!
//! * [`Fault::NoCdiIds`] and [`Fault::AllGpus`]: a kubelet plugin in front
//!   of a real `tessera plugin` (which registers nowhere the kubelet looks)
//!   that forwards the kubelet's calls and spoils the answer to
//!   NodePrepareResources: no CDI ids at all, or the id of a spec that hands
//!   the container every GPU of the node.
//! * [`strip_counters`]: the node's slices without shared counters, as a
//!   publisher that never charges a GPU for its partitions would write them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use serde_json::{Value, json};
use tessera_api::kubelet::{self, dra_v1, registration};
use tessera_driver::kubelet::authority;
use tokio::net::UnixListener;
use tokio::task::JoinHandle;
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status};

/// What the proxy does to the answer of NodePrepareResources.
#[derive(Debug, Clone)]
pub enum Fault {
    /// Devices come back without CDI ids: the container gets nothing.
    NoCdiIds,
    /// Every device's CDI id names one spec device exposing every
    /// `/dev/nvidia<N>` below the driver root, written to `cdi_dir`.
    AllGpus { cdi_dir: PathBuf, dev_root: PathBuf },
}

/// How long the kubelet may take to find and accept the plugin.
const REGISTRATION_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// CDI kind of the spec [`Fault::AllGpus`] writes.
const ALL_GPUS_KIND: &str = "broken.tessera.test/gpu";

/// The kubelet-facing plugin; stops (and removes its sockets) when dropped.
pub struct FaultyPlugin {
    servers: Vec<JoinHandle<()>>,
    sockets: Vec<PathBuf>,
}

impl Drop for FaultyPlugin {
    fn drop(&mut self) {
        for s in &self.servers {
            s.abort();
        }
        for s in &self.sockets {
            let _ = std::fs::remove_file(s);
        }
    }
}

impl FaultyPlugin {
    /// Registers with the kubelet as `driver` and forwards to the DRA socket
    /// `upstream` (a `tessera plugin` serving the same driver name).
    pub async fn start(
        kubelet: &tessera_conformance::KubeletDirs,
        driver: &str,
        upstream: Channel,
        fault: Fault,
    ) -> Result<Self> {
        if let Fault::AllGpus { cdi_dir, dev_root } = &fault {
            write_all_gpus_spec(cdi_dir, dev_root)?;
        }
        let dra_dir = kubelet.plugins.join(driver);
        std::fs::create_dir_all(&dra_dir)?;
        let dra_socket = dra_dir.join("broken-dra.sock");
        let reg_socket = kubelet.registry.join(format!("{driver}-broken-reg.sock"));
        for s in [&dra_socket, &reg_socket] {
            let _ = std::fs::remove_file(s);
        }
        let dra_listener = UnixListener::bind(&dra_socket).context("binding the DRA socket")?;
        let reg_listener =
            UnixListener::bind(&reg_socket).context("binding the registration socket")?;

        let proxy = Proxy {
            upstream: dra_v1::dra_plugin_client::DraPluginClient::new(upstream),
            fault: Arc::new(fault),
        };
        let dra = tokio::spawn(async move {
            let _ = Server::builder()
                .add_service(dra_v1::dra_plugin_server::DraPluginServer::new(proxy))
                .serve_with_incoming(authority::incoming(dra_listener))
                .await;
        });
        let (registered, mut accepted) = tokio::sync::watch::channel(false);
        let info = Registration {
            driver: driver.to_owned(),
            endpoint: dra_socket.to_string_lossy().into_owned(),
            registered,
        };
        let reg = tokio::spawn(async move {
            let _ = Server::builder()
                .add_service(registration::registration_server::RegistrationServer::new(
                    info,
                ))
                .serve_with_incoming(authority::incoming(reg_listener))
                .await;
        });
        let plugin = FaultyPlugin {
            servers: vec![dra, reg],
            sockets: vec![dra_socket, reg_socket],
        };
        // Pods created before the kubelet knows the driver wait out a backoff.
        tokio::time::timeout(REGISTRATION_TIMEOUT, accepted.wait_for(|r| *r))
            .await
            .with_context(|| {
                format!("the kubelet did not register {driver} within {REGISTRATION_TIMEOUT:?}")
            })??;
        Ok(plugin)
    }
}

/// One CDI device with every GPU node of the node: what a driver that
/// ignores the allocation would hand each container.
fn write_all_gpus_spec(cdi_dir: &Path, dev_root: &Path) -> Result<()> {
    let mut nodes: Vec<Value> = std::fs::read_dir(dev_root)?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| {
            n.strip_prefix("nvidia")
                .is_some_and(|m| !m.is_empty() && m.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(|n| json!({ "path": format!("/dev/{n}"), "hostPath": dev_root.join(&n) }))
        .collect();
    nodes.sort_by_key(|n| n["path"].as_str().map(str::to_owned));
    let spec = json!({
        "cdiVersion": "0.6.0",
        "kind": ALL_GPUS_KIND,
        "devices": [{ "name": "all", "containerEdits": { "deviceNodes": nodes } }],
    });
    std::fs::create_dir_all(cdi_dir)?;
    let path = cdi_dir.join("broken.tessera.test-all-gpus.json");
    std::fs::write(path.with_extension("tmp"), serde_json::to_vec(&spec)?)?;
    std::fs::rename(path.with_extension("tmp"), &path)?;
    Ok(())
}

struct Registration {
    driver: String,
    endpoint: String,
    /// Set once the kubelet says it registered the plugin.
    registered: tokio::sync::watch::Sender<bool>,
}

#[tonic::async_trait]
impl registration::registration_server::Registration for Registration {
    async fn get_info(
        &self,
        _: Request<registration::InfoRequest>,
    ) -> Result<Response<registration::PluginInfo>, Status> {
        Ok(Response::new(registration::PluginInfo {
            r#type: kubelet::DRA_PLUGIN_TYPE.to_owned(),
            name: self.driver.clone(),
            endpoint: self.endpoint.clone(),
            supported_versions: vec![kubelet::DRA_V1_SERVICE.to_owned()],
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<registration::RegistrationStatus>,
    ) -> Result<Response<registration::RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            self.registered.send_replace(true);
        } else {
            eprintln!("the kubelet refused {}: {}", self.driver, status.error);
        }
        Ok(Response::new(registration::RegistrationStatusResponse {}))
    }
}

#[derive(Clone)]
struct Proxy {
    upstream: dra_v1::dra_plugin_client::DraPluginClient<Channel>,
    fault: Arc<Fault>,
}

#[tonic::async_trait]
impl dra_v1::dra_plugin_server::DraPlugin for Proxy {
    async fn node_prepare_resources(
        &self,
        request: Request<dra_v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<dra_v1::NodePrepareResourcesResponse>, Status> {
        let mut answer = self
            .upstream
            .clone()
            .node_prepare_resources(request.into_inner())
            .await?
            .into_inner();
        for claim in answer.claims.values_mut() {
            for device in &mut claim.devices {
                device.cdi_device_ids = match &*self.fault {
                    Fault::NoCdiIds => Vec::new(),
                    Fault::AllGpus { .. } => vec![format!("{ALL_GPUS_KIND}=all")],
                };
            }
        }
        Ok(Response::new(answer))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<dra_v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<dra_v1::NodeUnprepareResourcesResponse>, Status> {
        self.upstream
            .clone()
            .node_unprepare_resources(request.into_inner())
            .await
    }
}

/// The slices with every trace of shared counters removed: no counter sets,
/// no device consuming them. Slices that only carried counters are dropped
/// (and the pool's slice count says so, or the scheduler would wait for them).
pub fn strip_counters(slices: Vec<Value>) -> Vec<Value> {
    let mut kept: Vec<Value> = slices
        .into_iter()
        .filter_map(|mut s| {
            let spec = s.get_mut("spec")?.as_object_mut()?;
            spec.remove("sharedCounters");
            let devices = spec.get_mut("devices").and_then(Value::as_array_mut)?;
            if devices.is_empty() {
                return None;
            }
            for d in devices.iter_mut() {
                if let Some(d) = d.as_object_mut() {
                    d.remove("consumesCounters");
                }
            }
            Some(s)
        })
        .collect();
    let count = kept.len();
    for s in &mut kept {
        s["spec"]["pool"]["resourceSliceCount"] = count.into();
    }
    kept
}
