//! The kubelet protocols as the kubelet sees them: full gRPC method paths,
//! service names announced at registration, and field numbers on the wire.
//!
//! Each round trip runs a generated client against a generated server in
//! process, through a recorder that captures the HTTP/2 `:path`. The paths
//! are compared with literals spelled out here (not with the constants the
//! code uses), so a typo in a `.proto` package or service cannot agree with
//! itself.

#![allow(clippy::unwrap_used)] // test code: a panic is how it reports a failure

use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use prost::Message;
use tessera_api::kubelet::{self, dra_v1, dra_v1beta1, health, methods, registration};
use tonic::codegen::{Service, http};
use tonic::{Request, Response, Status};

/// Forwards to the server and remembers every request path.
#[derive(Clone)]
struct Recorder<S> {
    inner: S,
    paths: Arc<Mutex<Vec<String>>>,
}

impl<S> Recorder<S> {
    fn new(inner: S) -> Self {
        Recorder {
            inner,
            paths: Arc::default(),
        }
    }

    fn paths(&self) -> Vec<String> {
        self.paths.lock().unwrap().clone()
    }
}

impl<S> Service<http::Request<tonic::body::Body>> for Recorder<S>
where
    S: Service<http::Request<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> S::Future {
        self.paths.lock().unwrap().push(req.uri().path().to_owned());
        self.inner.call(req)
    }
}

/// DRA v1 and v1beta1 have identical messages; one test body serves both.
macro_rules! dra_round_trip {
    ($test:ident, $pkg:ident, $prepare:literal, $unprepare:literal) => {
        #[tokio::test]
        async fn $test() {
            use $pkg::dra_plugin_client::DraPluginClient;
            use $pkg::dra_plugin_server::{DraPlugin, DraPluginServer};

            struct Plugin;

            #[tonic::async_trait]
            impl DraPlugin for Plugin {
                async fn node_prepare_resources(
                    &self,
                    request: Request<$pkg::NodePrepareResourcesRequest>,
                ) -> Result<Response<$pkg::NodePrepareResourcesResponse>, Status> {
                    let claims = request
                        .into_inner()
                        .claims
                        .into_iter()
                        .map(|c| {
                            let answer = $pkg::NodePrepareResourceResponse {
                                devices: vec![$pkg::Device {
                                    request_names: vec!["gpu".into()],
                                    pool_name: "node-a".into(),
                                    device_name: "gpu-0".into(),
                                    cdi_device_ids: vec![format!("tessera.dev/gpu={}", c.uid)],
                                }],
                                error: String::new(),
                            };
                            (c.uid, answer)
                        })
                        .collect();
                    Ok(Response::new($pkg::NodePrepareResourcesResponse { claims }))
                }

                async fn node_unprepare_resources(
                    &self,
                    request: Request<$pkg::NodeUnprepareResourcesRequest>,
                ) -> Result<Response<$pkg::NodeUnprepareResourcesResponse>, Status> {
                    let claims = request
                        .into_inner()
                        .claims
                        .into_iter()
                        .map(|c| {
                            let answer = $pkg::NodeUnprepareResourceResponse {
                                error: format!("{}/{} not found", c.namespace, c.name),
                            };
                            (c.uid, answer)
                        })
                        .collect();
                    Ok(Response::new($pkg::NodeUnprepareResourcesResponse {
                        claims,
                    }))
                }
            }

            let recorder = Recorder::new(DraPluginServer::new(Plugin));
            let mut client = DraPluginClient::new(recorder.clone());
            let claim = $pkg::Claim {
                namespace: "team".into(),
                uid: "uid-1".into(),
                name: "train".into(),
            };

            let prepared = client
                .node_prepare_resources($pkg::NodePrepareResourcesRequest {
                    claims: vec![claim.clone()],
                })
                .await
                .expect("prepare")
                .into_inner();
            let answer = &prepared.claims["uid-1"];
            assert_eq!(answer.devices[0].cdi_device_ids, ["tessera.dev/gpu=uid-1"]);
            assert_eq!(answer.devices[0].pool_name, "node-a");

            let unprepared = client
                .node_unprepare_resources($pkg::NodeUnprepareResourcesRequest {
                    claims: vec![claim],
                })
                .await
                .expect("unprepare")
                .into_inner();
            assert_eq!(unprepared.claims["uid-1"].error, "team/train not found");

            assert_eq!(recorder.paths(), [$prepare, $unprepare]);
        }
    };
}

dra_round_trip!(
    dra_v1_round_trip,
    dra_v1,
    "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
    "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources"
);

dra_round_trip!(
    dra_v1beta1_round_trip,
    dra_v1beta1,
    "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources",
    "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources"
);

#[tokio::test]
async fn registration_round_trip() {
    use registration::registration_client::RegistrationClient;
    use registration::registration_server::{Registration, RegistrationServer};

    struct Plugin {
        seen: Arc<Mutex<Option<registration::RegistrationStatus>>>,
    }

    #[tonic::async_trait]
    impl Registration for Plugin {
        async fn get_info(
            &self,
            _: Request<registration::InfoRequest>,
        ) -> Result<Response<registration::PluginInfo>, Status> {
            Ok(Response::new(registration::PluginInfo {
                r#type: kubelet::DRA_PLUGIN_TYPE.into(),
                name: tessera_api::names::DEFAULT_DRIVER_NAME.into(),
                endpoint: "plugins/gpu.tessera.dev/dra.sock".into(),
                supported_versions: vec![
                    kubelet::DRA_V1_SERVICE.into(),
                    kubelet::DRA_V1BETA1_SERVICE.into(),
                ],
            }))
        }

        async fn notify_registration_status(
            &self,
            request: Request<registration::RegistrationStatus>,
        ) -> Result<Response<registration::RegistrationStatusResponse>, Status> {
            *self.seen.lock().unwrap() = Some(request.into_inner());
            Ok(Response::new(registration::RegistrationStatusResponse {}))
        }
    }

    let seen = Arc::default();
    let recorder = Recorder::new(RegistrationServer::new(Plugin {
        seen: Arc::clone(&seen),
    }));
    let mut client = RegistrationClient::new(recorder.clone());

    let info = client
        .get_info(registration::InfoRequest {})
        .await
        .expect("GetInfo")
        .into_inner();
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, "gpu.tessera.dev");
    assert_eq!(
        info.supported_versions,
        ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    );

    client
        .notify_registration_status(registration::RegistrationStatus {
            plugin_registered: false,
            error: "socket gone".into(),
        })
        .await
        .expect("NotifyRegistrationStatus");
    assert_eq!(seen.lock().unwrap().as_ref().unwrap().error, "socket gone");

    assert_eq!(
        recorder.paths(),
        [
            "/pluginregistration.Registration/GetInfo",
            "/pluginregistration.Registration/NotifyRegistrationStatus"
        ]
    );
}

/// Health v1alpha1, v1beta1 and v1 differ in package name only; the stream
/// round trip is the same.
macro_rules! health_round_trip {
    ($test:ident, $pkg:ident, $path:literal, { $($extra:tt)* }) => {
        #[tokio::test]
        async fn $test() {
            use health::$pkg as h;
            use h::dra_resource_health_client::DraResourceHealthClient;
            use h::dra_resource_health_server::{DraResourceHealth, DraResourceHealthServer};

            struct Plugin;

            #[tonic::async_trait]
            impl DraResourceHealth for Plugin {
                type NodeWatchResourcesStream =
                    tonic::codegen::BoxStream<h::NodeWatchResourcesResponse>;

                async fn node_watch_resources(
                    &self,
                    _: Request<h::NodeWatchResourcesRequest>,
                ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
                    let snapshot = h::NodeWatchResourcesResponse {
                        devices: vec![h::DeviceHealth {
                            device: Some(h::DeviceIdentifier {
                                pool_name: "node-a".into(),
                                device_name: "gpu-1".into(),
                            }),
                            health: h::HealthStatus::Unhealthy as i32,
                            last_updated_time: 1_700_000_000,
                            $($extra)*
                        }],
                    };
                    let stream = tonic::codegen::tokio_stream::iter([Ok(snapshot)]);
                    Ok(Response::new(Box::pin(stream)))
                }
            }

            let recorder = Recorder::new(DraResourceHealthServer::new(Plugin));
            let mut client = DraResourceHealthClient::new(recorder.clone());
            let mut stream = client
                .node_watch_resources(h::NodeWatchResourcesRequest {})
                .await
                .expect("NodeWatchResources")
                .into_inner();
            let first = stream.message().await.expect("message").expect("one snapshot");
            assert_eq!(first.devices[0].health(), h::HealthStatus::Unhealthy);
            assert_eq!(first.devices[0].device.as_ref().unwrap().device_name, "gpu-1");
            assert!(stream.message().await.expect("end").is_none());
            assert_eq!(recorder.paths(), [$path]);
        }
    };
}

health_round_trip!(
    health_v1alpha1_round_trip,
    v1alpha1,
    "/v1alpha1.DRAResourceHealth/NodeWatchResources",
    { health_check_timeout_seconds: 30, message: "XID 79".into(), }
);
health_round_trip!(
    health_v1beta1_round_trip,
    v1beta1,
    "/v1beta1.DRAResourceHealth/NodeWatchResources",
    { health_check_timeout_seconds: 30, message: "XID 79".into(), }
);
health_round_trip!(
    health_v1_round_trip,
    v1,
    "/v1.DRAResourceHealth/NodeWatchResources",
    { health_check_timeout_seconds: 30, message: "XID 79".into(), }
);

#[test]
fn method_constants_match_the_wire() {
    assert_eq!(
        [
            methods::DRA_V1_PREPARE,
            methods::DRA_V1_UNPREPARE,
            methods::DRA_V1BETA1_PREPARE,
            methods::DRA_V1BETA1_UNPREPARE,
            methods::REGISTRATION_GET_INFO,
            methods::REGISTRATION_NOTIFY,
            methods::HEALTH_V1ALPHA1_WATCH,
            methods::HEALTH_V1BETA1_WATCH,
            methods::HEALTH_V1_WATCH,
        ],
        [
            "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
            "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources",
            "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources",
            "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources",
            "/pluginregistration.Registration/GetInfo",
            "/pluginregistration.Registration/NotifyRegistrationStatus",
            "/v1alpha1.DRAResourceHealth/NodeWatchResources",
            "/v1beta1.DRAResourceHealth/NodeWatchResources",
            "/v1.DRAResourceHealth/NodeWatchResources",
        ]
    );
}

/// The strings a plugin announces in `supported_versions` are the last
/// package component plus the service name; the kubelet matches them
/// exactly.
#[test]
fn announced_services_match_generated_service_names() {
    let last = |full: &str| {
        let (package, service) = full.rsplit_once('.').unwrap();
        format!("{}.{service}", package.rsplit('.').next().unwrap())
    };
    assert_eq!(
        last(dra_v1::dra_plugin_server::SERVICE_NAME),
        kubelet::DRA_V1_SERVICE
    );
    assert_eq!(
        last(dra_v1beta1::dra_plugin_server::SERVICE_NAME),
        kubelet::DRA_V1BETA1_SERVICE
    );
    assert_eq!(
        health::v1::dra_resource_health_server::SERVICE_NAME,
        kubelet::HEALTH_V1_SERVICE
    );
    assert_eq!(
        health::v1beta1::dra_resource_health_server::SERVICE_NAME,
        kubelet::HEALTH_V1BETA1_SERVICE
    );
    assert_eq!(
        health::v1alpha1::dra_resource_health_server::SERVICE_NAME,
        kubelet::HEALTH_V1ALPHA1_SERVICE
    );
    assert_eq!(kubelet::DRA_V1_SERVICE, "v1.DRAPlugin");
    assert_eq!(kubelet::DRA_V1BETA1_SERVICE, "v1beta1.DRAPlugin");
    assert_eq!(kubelet::DRA_PLUGIN_TYPE, "DRAPlugin");
}

/// Field numbers and wire types, byte for byte (tag = number << 3 | type).
#[test]
fn field_numbers_on_the_wire() {
    let claim = dra_v1::Claim {
        namespace: "n".into(),
        uid: "u".into(),
        name: "c".into(),
    };
    assert_eq!(claim.encode_to_vec(), b"\x0a\x01n\x12\x01u\x1a\x01c");

    let device = dra_v1::Device {
        request_names: vec!["r".into()],
        pool_name: "p".into(),
        device_name: "d".into(),
        cdi_device_ids: vec!["x".into()],
    };
    assert_eq!(
        device.encode_to_vec(),
        b"\x0a\x01r\x12\x01p\x1a\x01d\x22\x01x"
    );

    let prepared = dra_v1::NodePrepareResourcesResponse {
        claims: [(
            "u".to_owned(),
            dra_v1::NodePrepareResourceResponse {
                devices: vec![],
                error: "e".into(),
            },
        )]
        .into(),
    };
    // claims = 1 is a map entry message {key = 1, value = 2}; error = 2.
    assert_eq!(
        prepared.encode_to_vec(),
        b"\x0a\x08\x0a\x01u\x12\x03\x12\x01e"
    );

    let unprepared = dra_v1beta1::NodeUnprepareResourceResponse { error: "e".into() };
    assert_eq!(unprepared.encode_to_vec(), b"\x0a\x01e");

    let info = registration::PluginInfo {
        r#type: "t".into(),
        name: "n".into(),
        endpoint: "e".into(),
        supported_versions: vec!["v".into()],
    };
    assert_eq!(
        info.encode_to_vec(),
        b"\x0a\x01t\x12\x01n\x1a\x01e\x22\x01v"
    );

    let status = registration::RegistrationStatus {
        plugin_registered: true,
        error: "e".into(),
    };
    assert_eq!(status.encode_to_vec(), b"\x08\x01\x12\x01e");

    let health = health::v1::DeviceHealth {
        device: Some(health::v1::DeviceIdentifier {
            pool_name: "p".into(),
            device_name: "d".into(),
        }),
        health: health::v1::HealthStatus::Unhealthy as i32,
        last_updated_time: 5,
        health_check_timeout_seconds: 7,
        message: "m".into(),
    };
    assert_eq!(
        health.encode_to_vec(),
        b"\x0a\x06\x0a\x01p\x12\x01d\x10\x02\x18\x05\x20\x07\x2a\x01m"
    );
    assert_eq!(health::v1alpha1::HealthStatus::Healthy as i32, 1);
    assert_eq!(health::v1alpha1::HealthStatus::Unknown as i32, 0);
}
