//! The kubelet plugin's servers: plugin registration and the DRA node service.
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
pub mod health;
pub mod sockets;

use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tessera_api::kubelet::{self, dra_v1, dra_v1beta1, registration};
use tokio::sync::watch;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};
use tracing::{error, info, warn};

use crate::prepare::Preparer;
use crate::prepare::claims::ClaimRef;
use health::HealthService;

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
    on_registration: Option<OnRegistration>,
}

/// Told what the kubelet said of the registration (true: accepted).
pub type OnRegistration = Arc<dyn Fn(bool) + Send + Sync>;

/// How long calls in flight get to finish at shutdown.
const DRAIN: Duration = Duration::from_secs(20);

impl Plugin {
    pub fn new(config: PluginConfig, preparer: Arc<Preparer>) -> Self {
        Plugin {
            config,
            preparer,
            health: None,
            on_registration: None,
        }
    }

    /// Tells `on_registration` what the kubelet says of the registration.
    pub fn on_registration(mut self, on_registration: OnRegistration) -> Self {
        self.on_registration = Some(on_registration);
        self
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
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), ServeError> {
        let sockets = self.bind_sockets()?;
        let (mut servers, stops) = self.serve(sockets.listeners, &sockets.dra);
        info!(
            registration = %sockets.registration.display(),
            dra = %sockets.dra.display(),
            "kubelet plugin {} serving", self.config.driver_name
        );
        let failure = servers.until_one_stops(shutdown).await;
        // Deregister first, then drain.
        let _ = std::fs::remove_file(&sockets.registration);
        stops.stop();
        servers.drain().await;
        let _ = std::fs::remove_file(&sockets.dra);
        info!("kubelet plugin stopped; sockets removed");
        match failure {
            Some(failure) => {
                error!("{failure}");
                Err(failure)
            }
            None => Ok(()),
        }
    }

    /// Prepares the socket directories (stale sockets of earlier runs
    /// removed) and binds both sockets, the DRA one first: the kubelet may
    /// call it right after registration.
    fn bind_sockets(&self) -> Result<Bound, ServeError> {
        let driver = &self.config.driver_name;
        let registration = self.config.registration_socket();
        let dra = self.config.dra_socket();
        let dra_dir = sockets::dra_socket_dir(&self.config.plugins_dir, driver);
        sockets::ensure_private_dir(&dra_dir).map_err(|source| ServeError::SocketDir {
            dir: dra_dir.clone(),
            source,
        })?;
        if !self.config.registry_dir.is_dir() {
            return Err(ServeError::NoRegistry {
                dir: self.config.registry_dir.clone(),
            });
        }
        for stale in sockets::remove_stale(&dra_dir, "dra-", ".sock", &dra)
            .into_iter()
            .chain(sockets::remove_stale(
                &self.config.registry_dir,
                &format!("{driver}-"),
                "-reg.sock",
                &registration,
            ))
        {
            info!("removed stale socket {}", stale.display());
        }
        let listeners = Listeners {
            dra: listen(&dra)?,
            registration: listen(&registration)?,
        };
        Ok(Bound {
            registration,
            dra,
            listeners,
        })
    }

    /// Starts both servers; each stops when told through `Stops`.
    fn serve(&self, listeners: Listeners, dra_socket: &Path) -> (Servers, Stops) {
        let (stop_reg, reg_stopped) = watch::channel(false);
        let (stop_dra, dra_stopped) = watch::channel(false);
        let until = |mut rx: watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|stop| *stop).await;
        };
        let registration = Registration {
            driver: self.config.driver_name.clone(),
            endpoint: dra_socket.to_string_lossy().into_owned(),
            health: self.health.is_some(),
            on_registration: self.on_registration.clone(),
        };
        // Health streams end when the DRA server stops (they would hold
        // the drain up otherwise).
        let health = self.health.clone().map(|h| {
            kubelet::health::v1alpha1::dra_resource_health_server::DraResourceHealthServer::new(
                h.until(dra_stopped.clone()),
            )
        });
        let registration = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(registration::registration_server::RegistrationServer::new(
                    registration,
                ))
                .serve_with_incoming_shutdown(
                    authority::incoming(listeners.registration),
                    until(reg_stopped),
                ),
        );
        let dra = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(dra_v1::dra_plugin_server::DraPluginServer::new(DraV1(
                    self.preparer.clone(),
                )))
                .add_service(dra_v1beta1::dra_plugin_server::DraPluginServer::new(
                    DraV1beta1(self.preparer.clone()),
                ))
                .add_optional_service(health)
                // Kubelets from 1.34 dial this socket as `unix:<path>`, so
                // grpc-go sends `localhost`: no rewrite on the calls' path.
                .serve_with_incoming_shutdown(
                    UnixListenerStream::new(listeners.dra),
                    until(dra_stopped),
                ),
        );
        (
            Servers { registration, dra },
            Stops {
                registration: stop_reg,
                dra: stop_dra,
            },
        )
    }
}

/// Why the kubelet plugin could not serve, or stopped serving.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("creating the DRA socket directory {}: {source}", dir.display())]
    SocketDir {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "the kubelet's plugin registry directory {} does not exist (is the kubelet's root \
         directory mounted into the plugin, and --kubelet-registry-dir right?)",
        dir.display()
    )]
    NoRegistry { dir: PathBuf },
    #[error("binding {}: {source}", socket.display())]
    Bind {
        socket: PathBuf,
        source: std::io::Error,
    },
    #[error("{which} server stopped: {why}")]
    Stopped { which: &'static str, why: String },
}

/// Binds `socket` for the async runtime.
fn listen(socket: &Path) -> Result<tokio::net::UnixListener, ServeError> {
    let bind_error = |source| ServeError::Bind {
        socket: socket.to_owned(),
        source,
    };
    let listener = sockets::bind(socket).map_err(bind_error)?;
    tokio::net::UnixListener::from_std(listener).map_err(bind_error)
}

/// Both sockets, bound.
struct Bound {
    registration: PathBuf,
    dra: PathBuf,
    listeners: Listeners,
}

struct Listeners {
    registration: tokio::net::UnixListener,
    dra: tokio::net::UnixListener,
}

type Server = tokio::task::JoinHandle<Result<(), tonic::transport::Error>>;

/// The two servers, running.
struct Servers {
    registration: Server,
    dra: Server,
}

/// Tells each server to stop taking calls.
struct Stops {
    registration: watch::Sender<bool>,
    dra: watch::Sender<bool>,
}

impl Stops {
    fn stop(&self) {
        let _ = self.registration.send(true);
        let _ = self.dra.send(true);
    }
}

impl Servers {
    /// Waits for `shutdown`, or for a server to stop by itself (a failure).
    async fn until_one_stops(&mut self, shutdown: impl Future<Output = ()>) -> Option<ServeError> {
        let stopped = |which, r| ServeError::Stopped {
            which,
            why: describe(r),
        };
        tokio::select! {
            () = shutdown => {
                info!("shutting down the kubelet plugin");
                None
            }
            r = &mut self.registration => Some(stopped("registration", r)),
            r = &mut self.dra => Some(stopped("DRA", r)),
        }
    }

    /// Lets calls in flight finish, up to [`DRAIN`].
    async fn drain(self) {
        for (name, server) in [("registration", self.registration), ("DRA", self.dra)] {
            if server.is_finished() {
                continue;
            }
            if tokio::time::timeout(DRAIN, server).await.is_err() {
                warn!("{name} server did not stop within {DRAIN:?}");
            }
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
    on_registration: Option<OnRegistration>,
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
        if let Some(tell) = &self.on_registration {
            tell(status.plugin_registered);
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
