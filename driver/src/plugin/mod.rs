//! The kubelet plugin server: plugin registration and the DRA node service.
//!
//! Two gRPC servers on unix sockets (see [`sockets`] for names and
//! permissions):
//!
//! * registration (`pluginregistration.Registration`) in the kubelet's
//!   plugin registry directory: `GetInfo` answers type `DRAPlugin`, the
//!   driver name, the DRA socket path and the service versions, `v1` first
//!   (kubelets pick the first they know); `NotifyRegistrationStatus` is
//!   logged, a refusal as an error with the kubelet's reason;
//! * the DRA service, `v1` and `v1beta1` from one implementation
//!   ([`crate::prepare::Preparer`]), in `<plugins dir>/<driver>/`, and on
//!   the same socket, when given ([`Plugin::with_health`]), device health
//!   (`v1alpha1.DRAResourceHealth`, [`crate::health`]): kubelets call it there
//!   unconditionally and log `Unimplemented` where it is missing; it is also
//!   listed in `GetInfo`'s versions, as upstream's helper does.
//!
//! [`Plugin::run`] serves until its shutdown future completes, then removes
//! the registration socket first (the kubelet stops routing to this
//! instance), lets calls in flight finish, and removes the DRA socket.

pub mod authority;
pub mod cli;
pub mod heap;
pub mod sockets;

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tessera_api::kubelet::{self, dra_v1, dra_v1beta1, registration};
use tokio::sync::watch;
use tonic::{Request, Response, Status};
use tracing::{error, info, warn};

use crate::health::HealthService;
use crate::prepare::Preparer;
use crate::prepare::claims::ClaimRef;

/// Where the plugin's sockets go.
#[derive(Debug, Clone)]
pub struct PluginConfig {
    pub driver_name: String,
    /// The kubelet's plugin registry directory
    /// (`/var/lib/kubelet/plugins_registry`).
    pub registry_dir: PathBuf,
    /// The kubelet's plugin directory (`/var/lib/kubelet/plugins`).
    pub plugins_dir: PathBuf,
    /// Unique per process ([`sockets::instance_id`]).
    pub instance: String,
}

impl PluginConfig {
    pub fn registration_socket(&self) -> PathBuf {
        sockets::registration_socket(&self.registry_dir, &self.driver_name, &self.instance)
    }

    pub fn dra_socket(&self) -> PathBuf {
        sockets::dra_socket(&self.plugins_dir, &self.driver_name, &self.instance)
    }
}

/// A kubelet plugin serving one [`Preparer`].
pub struct Plugin {
    config: PluginConfig,
    preparer: Arc<Preparer>,
    health: Option<HealthService>,
}

/// How long calls in flight get to finish at shutdown.
const DRAIN: Duration = Duration::from_secs(20);

impl Plugin {
    pub fn new(config: PluginConfig, preparer: Arc<Preparer>) -> Self {
        Plugin {
            config,
            preparer,
            health: None,
        }
    }

    /// Serves device health on the DRA socket too.
    pub fn with_health(mut self, health: HealthService) -> Self {
        self.health = Some(health);
        self
    }

    pub fn config(&self) -> &PluginConfig {
        &self.config
    }

    /// Binds both sockets, serves until `shutdown` completes, then removes
    /// the sockets. Errors only when a socket cannot be set up or a server
    /// fails.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> anyhow::Result<()> {
        use anyhow::Context as _;
        let driver = &self.config.driver_name;
        let reg_path = self.config.registration_socket();
        let dra_path = self.config.dra_socket();
        let dra_dir = sockets::dra_socket_dir(&self.config.plugins_dir, driver);
        sockets::ensure_private_dir(&dra_dir)
            .with_context(|| format!("creating the DRA socket directory {}", dra_dir.display()))?;
        if !self.config.registry_dir.is_dir() {
            anyhow::bail!(
                "the kubelet's plugin registry directory {} does not exist (is the kubelet's \
                 root directory mounted into the plugin, and --kubelet-registry-dir right?)",
                self.config.registry_dir.display()
            );
        }
        for stale in sockets::remove_stale(&dra_dir, "dra-", ".sock", &dra_path)
            .into_iter()
            .chain(sockets::remove_stale(
                &self.config.registry_dir,
                &format!("{driver}-"),
                "-reg.sock",
                &reg_path,
            ))
        {
            info!("removed stale socket {}", stale.display());
        }

        // The DRA service first: the kubelet may call it right after
        // registration.
        let dra_listener =
            sockets::bind(&dra_path).with_context(|| format!("binding {}", dra_path.display()))?;
        let dra_listener = tokio::net::UnixListener::from_std(dra_listener)?;
        let reg_listener =
            sockets::bind(&reg_path).with_context(|| format!("binding {}", reg_path.display()))?;
        let reg_listener = tokio::net::UnixListener::from_std(reg_listener)?;

        let (stop_reg, reg_stopped) = watch::channel(false);
        let (stop_dra, dra_stopped) = watch::channel(false);
        let until = |mut rx: watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|stop| *stop).await;
        };

        let registration = Registration {
            driver: driver.clone(),
            endpoint: dra_path.to_string_lossy().into_owned(),
            health: self.health.is_some(),
        };
        // Health streams end when the DRA server stops (they would hold
        // the drain up otherwise).
        let health = self.health.map(|h| {
            kubelet::health::v1alpha1::dra_resource_health_server::DraResourceHealthServer::new(
                h.until(dra_stopped.clone()),
            )
        });
        let mut reg_server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(registration::registration_server::RegistrationServer::new(
                    registration,
                ))
                .serve_with_incoming_shutdown(
                    authority::incoming(reg_listener),
                    until(reg_stopped),
                ),
        );
        let mut dra_server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(dra_v1::dra_plugin_server::DraPluginServer::new(DraV1(
                    self.preparer.clone(),
                )))
                .add_service(dra_v1beta1::dra_plugin_server::DraPluginServer::new(
                    DraV1beta1(self.preparer.clone()),
                ))
                .add_optional_service(health)
                .serve_with_incoming_shutdown(
                    authority::incoming(dra_listener),
                    until(dra_stopped),
                ),
        );
        info!(
            registration = %reg_path.display(),
            dra = %dra_path.display(),
            "kubelet plugin {driver} serving"
        );

        let mut failure = None;
        tokio::select! {
            () = shutdown => info!("shutting down the kubelet plugin"),
            r = &mut reg_server => failure = Some(format!("registration server stopped: {}", describe(r))),
            r = &mut dra_server => failure = Some(format!("DRA server stopped: {}", describe(r))),
        }

        // Deregister first, then drain.
        let _ = std::fs::remove_file(&reg_path);
        let _ = stop_reg.send(true);
        let _ = stop_dra.send(true);
        for (name, server) in [("registration", reg_server), ("DRA", dra_server)] {
            if server.is_finished() {
                continue;
            }
            match tokio::time::timeout(DRAIN, server).await {
                Ok(_) => {}
                Err(_) => warn!("{name} server did not stop within {DRAIN:?}"),
            }
        }
        let _ = std::fs::remove_file(&dra_path);
        info!("kubelet plugin stopped; sockets removed");
        match failure {
            Some(f) => {
                error!("{f}");
                Err(anyhow::anyhow!(f))
            }
            None => Ok(()),
        }
    }
}

fn describe(r: Result<Result<(), tonic::transport::Error>, tokio::task::JoinError>) -> String {
    match r {
        Ok(Ok(())) => "without error".into(),
        Ok(Err(e)) => format!("{e}"),
        Err(e) => format!("{e}"),
    }
}

/// `pluginregistration.Registration`.
struct Registration {
    driver: String,
    endpoint: String,
    /// Device health is served.
    health: bool,
}

#[tonic::async_trait]
impl registration::registration_server::Registration for Registration {
    async fn get_info(
        &self,
        _request: Request<registration::InfoRequest>,
    ) -> Result<Response<registration::PluginInfo>, Status> {
        Ok(Response::new(registration::PluginInfo {
            r#type: kubelet::DRA_PLUGIN_TYPE.to_owned(),
            name: self.driver.clone(),
            endpoint: self.endpoint.clone(),
            supported_versions: [kubelet::DRA_V1_SERVICE, kubelet::DRA_V1BETA1_SERVICE]
                .into_iter()
                .chain(self.health.then_some(kubelet::HEALTH_V1ALPHA1_SERVICE))
                .map(str::to_owned)
                .collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<registration::RegistrationStatus>,
    ) -> Result<Response<registration::RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            info!(driver = %self.driver, "registered with the kubelet");
        } else {
            error!(
                driver = %self.driver,
                "the kubelet refused the registration: {} (claims of this driver cannot be \
                 prepared on this node until this is fixed)",
                if status.error.is_empty() { "no reason given" } else { &status.error }
            );
        }
        Ok(Response::new(registration::RegistrationStatusResponse {}))
    }
}

/// DRA v1 and v1beta1 have identical messages: one body, two packages.
macro_rules! dra_service {
    ($service:ident, $pkg:ident) => {
        struct $service(Arc<Preparer>);

        impl $service {
            fn claim_refs(claims: Vec<$pkg::Claim>) -> Vec<ClaimRef> {
                claims
                    .into_iter()
                    .map(|c| ClaimRef {
                        namespace: c.namespace,
                        name: c.name,
                        uid: c.uid,
                    })
                    .collect()
            }
        }

        #[tonic::async_trait]
        impl $pkg::dra_plugin_server::DraPlugin for $service {
            async fn node_prepare_resources(
                &self,
                request: Request<$pkg::NodePrepareResourcesRequest>,
            ) -> Result<Response<$pkg::NodePrepareResourcesResponse>, Status> {
                let claims = Self::claim_refs(request.into_inner().claims);
                let mut answer = HashMap::new();
                for (claim, result) in self.0.prepare(claims).await {
                    let entry = match result {
                        Ok(devices) => $pkg::NodePrepareResourceResponse {
                            devices: devices
                                .into_iter()
                                .map(|d| $pkg::Device {
                                    request_names: d.request_names,
                                    pool_name: d.pool_name,
                                    device_name: d.device_name,
                                    cdi_device_ids: d.cdi_device_ids,
                                })
                                .collect(),
                            error: String::new(),
                        },
                        Err(e) => $pkg::NodePrepareResourceResponse {
                            devices: Vec::new(),
                            error: e.to_string(),
                        },
                    };
                    answer.insert(claim.uid, entry);
                }
                Ok(Response::new($pkg::NodePrepareResourcesResponse {
                    claims: answer,
                }))
            }

            async fn node_unprepare_resources(
                &self,
                request: Request<$pkg::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$pkg::NodeUnprepareResourcesResponse>, Status> {
                let claims = Self::claim_refs(request.into_inner().claims);
                let mut answer = HashMap::new();
                for (claim, result) in self.0.unprepare(claims).await {
                    let error = result.err().map(|e| e.to_string()).unwrap_or_default();
                    answer.insert(claim.uid, $pkg::NodeUnprepareResourceResponse { error });
                }
                Ok(Response::new($pkg::NodeUnprepareResourcesResponse {
                    claims: answer,
                }))
            }
        }
    };
}

dra_service!(DraV1, dra_v1);
dra_service!(DraV1beta1, dra_v1beta1);
