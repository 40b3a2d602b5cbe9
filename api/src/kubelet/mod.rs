//! The kubelet's gRPC protocols, generated at build time from `proto/`.
//!
//! A DRA kubelet plugin serves three things:
//!
//! * plugin registration ([`registration`]) on a socket in the kubelet's
//!   `plugins_registry` directory, telling the kubelet the driver name, the
//!   DRA endpoint and which service versions it offers there;
//! * the DRA node service ([`dra_v1`], [`dra_v1beta1`]) on that endpoint:
//!   `NodePrepareResources` / `NodeUnprepareResources`;
//! * optionally device health ([`health`]) on the same endpoint, a server
//!   stream the kubelet folds into Pod status.
//!
//! The `.proto` files are our own rendering of the wire contract. Package,
//! service, message and field names and numbers are the contract itself and
//! must match the kubelet byte for byte; the constants below name the strings
//! a plugin has to get exactly right, and `tests/kubelet_protocol.rs` checks
//! them against the generated routing.
//!
//! Generated clients and servers carry no transport (`connect` helpers are
//! not generated): binaries serve them with their own unix-socket transport.

/// `k8s.io.kubelet.pkg.apis.dra.v1`: the DRA node service, GA since
/// Kubernetes 1.34 and preferred by kubelets that know it.
pub mod dra_v1 {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    include!(concat!(
        env!("OUT_DIR"),
        "/k8s.io.kubelet.pkg.apis.dra.v1.rs"
    ));
}

/// `k8s.io.kubelet.pkg.apis.dra.v1beta1`: the same service as [`dra_v1`]
/// (identical messages), for kubelets that predate v1 (1.33).
pub mod dra_v1beta1 {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    include!(concat!(
        env!("OUT_DIR"),
        "/k8s.io.kubelet.pkg.apis.dra.v1beta1.rs"
    ));
}

/// `pluginregistration` (the kubelet's v1 registration API; upstream never
/// put the version in the package name).
pub mod registration {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    include!(concat!(env!("OUT_DIR"), "/pluginregistration.rs"));
}

/// DRA device health (`DRAResourceHealth.NodeWatchResources`), one module per
/// protocol version. Upstream named the packages with the bare version
/// (`v1alpha1`, `v1beta1`, `v1`), which is what appears on the wire.
///
/// Kubelets (up to at least 1.36) call [`health::v1alpha1`] on the DRA
/// endpoint unconditionally when the `ResourceHealthStatus` gate is on (beta
/// and on by default in 1.36), retrying every 5 s; a plugin without it
/// answers `Unimplemented`. Upstream's Go helper also lists the service
/// ([`HEALTH_V1ALPHA1_SERVICE`]) in `PluginInfo.supported_versions`, which
/// 1.36 kubelets ignore. The messages of all three packages are identical
/// (1.36 added `health_check_timeout_seconds` and `message` to
/// `v1alpha1.DeviceHealth`); `v1beta1` and `v1` are our rendering of later
/// versions no released kubelet calls yet.
pub mod health {
    /// Package `v1alpha1`.
    pub mod v1alpha1 {
        #![allow(missing_docs, clippy::all, clippy::pedantic)]
        include!(concat!(env!("OUT_DIR"), "/v1alpha1.rs"));
    }
    /// Package `v1beta1`.
    pub mod v1beta1 {
        #![allow(missing_docs, clippy::all, clippy::pedantic)]
        include!(concat!(env!("OUT_DIR"), "/v1beta1.rs"));
    }
    /// Package `v1`.
    pub mod v1 {
        #![allow(missing_docs, clippy::all, clippy::pedantic)]
        include!(concat!(env!("OUT_DIR"), "/v1.rs"));
    }
}

/// `PluginInfo.type` for a DRA driver.
pub const DRA_PLUGIN_TYPE: &str = "DRAPlugin";

/// `PluginInfo.supported_versions` entry announcing [`dra_v1`].
pub const DRA_V1_SERVICE: &str = "v1.DRAPlugin";
/// `PluginInfo.supported_versions` entry announcing [`dra_v1beta1`].
pub const DRA_V1BETA1_SERVICE: &str = "v1beta1.DRAPlugin";
/// `PluginInfo.supported_versions` entry announcing [`health::v1`].
pub const HEALTH_V1_SERVICE: &str = "v1.DRAResourceHealth";
/// `PluginInfo.supported_versions` entry announcing [`health::v1beta1`].
pub const HEALTH_V1BETA1_SERVICE: &str = "v1beta1.DRAResourceHealth";
/// `PluginInfo.supported_versions` entry announcing [`health::v1alpha1`].
pub const HEALTH_V1ALPHA1_SERVICE: &str = "v1alpha1.DRAResourceHealth";

/// Full gRPC method paths (`/package.Service/Method`) as the kubelet sends
/// them in the HTTP/2 `:path`. Useful for interceptors, metrics labels and
/// tests that must not trust the generated code blindly.
pub mod methods {
    /// DRA v1 prepare.
    pub const DRA_V1_PREPARE: &str =
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources";
    /// DRA v1 unprepare.
    pub const DRA_V1_UNPREPARE: &str =
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources";
    /// DRA v1beta1 prepare.
    pub const DRA_V1BETA1_PREPARE: &str =
        "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources";
    /// DRA v1beta1 unprepare.
    pub const DRA_V1BETA1_UNPREPARE: &str =
        "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources";
    /// Registration: the kubelet asks who the plugin is.
    pub const REGISTRATION_GET_INFO: &str = "/pluginregistration.Registration/GetInfo";
    /// Registration: the kubelet reports the outcome.
    pub const REGISTRATION_NOTIFY: &str =
        "/pluginregistration.Registration/NotifyRegistrationStatus";
    /// Health v1alpha1 stream.
    pub const HEALTH_V1ALPHA1_WATCH: &str = "/v1alpha1.DRAResourceHealth/NodeWatchResources";
    /// Health v1beta1 stream.
    pub const HEALTH_V1BETA1_WATCH: &str = "/v1beta1.DRAResourceHealth/NodeWatchResources";
    /// Health v1 stream.
    pub const HEALTH_V1_WATCH: &str = "/v1.DRAResourceHealth/NodeWatchResources";
}
