//! What the kubelet gets: every published device with its GPU's health, as
//! the `DRAResourceHealth` stream.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use tessera_api::kubelet::health::v1alpha1 as h;
use tokio::sync::watch;
use tonic::{Request, Response, Status};
use tracing::info;

use crate::health::{
    HEALTH_CHECK_TIMEOUT_SECONDS, Health, HealthMap, HealthTracker, RESEND, fatal_meaning,
};
use crate::state::catalog::{Catalog, DeviceCatalog};

/// Every published device of `catalog` with its GPU's health.
pub fn report(pool: &str, catalog: Option<&Catalog>, health: &HealthMap) -> Vec<h::DeviceHealth> {
    let Some(catalog) = catalog else {
        return Vec::new();
    };
    catalog
        .devices()
        .map(|(name, device)| {
            let (status, since, message) = match health.get(&device.gpu_uuid) {
                Some(g) => match &g.health {
                    Health::Healthy => (h::HealthStatus::Healthy, g.since, String::new()),
                    Health::Unhealthy { xid } => (
                        h::HealthStatus::Unhealthy,
                        g.since,
                        format!(
                            "XID {xid} ({}) on GPU {}",
                            fatal_meaning(*xid).unwrap_or("fatal"),
                            device.gpu_uuid
                        ),
                    ),
                    Health::Unknown { reason } => {
                        (h::HealthStatus::Unknown, g.since, reason.clone())
                    }
                },
                None => (
                    h::HealthStatus::Unknown,
                    SystemTime::now(),
                    format!(
                        "GPU {} is not watched (it appeared after the driver started)",
                        device.gpu_uuid
                    ),
                ),
            };
            h::DeviceHealth {
                device: Some(h::DeviceIdentifier {
                    pool_name: pool.to_owned(),
                    device_name: name.clone(),
                }),
                health: status as i32,
                last_updated_time: since
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs() as i64),
                health_check_timeout_seconds: HEALTH_CHECK_TIMEOUT_SECONDS,
                message,
            }
        })
        .collect()
}

/// `v1alpha1.DRAResourceHealth` (what kubelets up to at least 1.36 call).
#[derive(Clone)]
pub struct HealthService {
    pool: String,
    catalog: Arc<DeviceCatalog>,
    tracker: Arc<HealthTracker>,
    stop: Option<watch::Receiver<bool>>,
}

impl HealthService {
    /// `pool` is the node's name.
    pub fn new(pool: String, catalog: Arc<DeviceCatalog>, tracker: Arc<HealthTracker>) -> Self {
        HealthService {
            pool,
            catalog,
            tracker,
            stop: None,
        }
    }

    /// Streams end when `stop` becomes true (the server shuts down).
    pub fn until(mut self, stop: watch::Receiver<bool>) -> Self {
        self.stop = Some(stop);
        self
    }
}

type WatchStream =
    Pin<Box<dyn futures::Stream<Item = Result<h::NodeWatchResourcesResponse, Status>> + Send>>;

#[tonic::async_trait]
impl h::dra_resource_health_server::DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = WatchStream;

    async fn node_watch_resources(
        &self,
        _request: Request<h::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let mut health = self.tracker.subscribe();
        let mut catalog = self.catalog.subscribe();
        let mut stop = self.stop.clone();
        let pool = self.pool.clone();
        info!("the kubelet watches device health");
        tokio::spawn(async move {
            loop {
                let devices = {
                    let map = health.borrow_and_update().clone();
                    let cat = catalog.borrow_and_update().clone();
                    report(&pool, cat.as_deref(), &map)
                };
                if tx
                    .send(Ok(h::NodeWatchResourcesResponse { devices }))
                    .await
                    .is_err()
                {
                    return;
                }
                let stopping = async {
                    match &mut stop {
                        Some(s) => {
                            let _ = s.wait_for(|stop| *stop).await;
                        }
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    r = health.changed() => if r.is_err() { return },
                    r = catalog.changed() => if r.is_err() { return },
                    () = tokio::time::sleep(RESEND) => {}
                    () = tx.closed() => return,
                    () = stopping => return,
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}
