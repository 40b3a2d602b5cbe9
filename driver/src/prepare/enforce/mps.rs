//! MPS per claim: each request's devices under MPS (Isolated shares whose
//! provider is `mps`, whole GPUs and MIG devices with `sharing.strategy:
//! MPS`) get the claim's own control daemon per device, started with the
//! request's limits as its defaults before any client can connect. The
//! request's containers get its pipe directory, its `/dev/shm` and the same
//! limits in their environment (which can only lower the daemon's).
//!
//! A CUDA process talks to one MPS daemon, so a request whose devices would
//! need two (two GPUs, or MPS beside non-MPS devices) is refused before any
//! daemon starts.

use std::collections::BTreeMap;
use std::sync::Arc;

use tessera_api::config::{EffectiveConfig, IsolationLevel, Limits, Sharing as ConfigSharing};
use tessera_controller::model::policy::IsolationProvider;

use super::{Device, Effects, EnforceError, Enforcer, Request, Undo};
use crate::cdi::{ContainerEdits, Mount};
use crate::host::port::{MpsControl, MpsTarget};
use crate::prepare::resolve::{Kind, Resolved};
use crate::state::records::{Action, DeviceData, LimitsData};

/// The limits a device's config asks for, whoever enforces them.
fn config_limits(config: &EffectiveConfig) -> Option<Limits> {
    match config {
        EffectiveConfig::Gpu {
            sharing: ConfigSharing::Mps { limits },
        }
        | EffectiveConfig::Mig {
            sharing: ConfigSharing::Mps { limits },
        } => Some(*limits),
        EffectiveConfig::Share { limits } => *limits,
        _ => None,
    }
}

/// Per-process limits a device's config asks MPS to enforce (none for a
/// share whose limits HAMi-core enforces).
pub fn limits(device: &Device) -> Option<Limits> {
    if super::hami_core::limits(device).is_some() {
        return None;
    }
    config_limits(&device.config)
}

/// The daemon of a device, once its MIG instance (if any) exists.
fn target(device: &Resolved) -> MpsTarget {
    MpsTarget {
        request: device.selected.request.clone(),
        gpu_uuid: device.gpu.uuid.clone(),
        mig_uuid: device.mig_instance().map(|i| i.uuid.clone()),
    }
}

/// What a daemon is started with: its clients' limits as its defaults, and
/// its GPU's device minor (the one GPU node its view holds).
struct Wanted {
    limits: Limits,
    gpu_minor: u32,
}

/// The daemons a claim needs: one per request and device, with the limits
/// of the request's devices there added up (two shares of one GPU in a
/// request are one client's), compute capped at 100%, the largest
/// `/dev/shm` asked for.
fn daemons(devices: &[Device]) -> BTreeMap<MpsTarget, Wanted> {
    let mut daemons: BTreeMap<MpsTarget, Wanted> = BTreeMap::new();
    for device in devices {
        let Some(l) = limits(device) else {
            continue;
        };
        let wanted = daemons.entry(target(&device.resolved)).or_insert(Wanted {
            limits: Limits {
                memory_bytes: 0,
                compute_percent: 0,
                shared_memory_bytes: None,
            },
            gpu_minor: device.resolved.gpu.minor,
        });
        let at = &mut wanted.limits;
        at.shared_memory_bytes = at.shared_memory_bytes.max(l.shared_memory_bytes);
        at.memory_bytes += l.memory_bytes;
        at.compute_percent = (at.compute_percent + l.compute_percent).min(100);
    }
    daemons
}

/// Refuses a request whose devices would need more than one daemon.
fn one_daemon_per_request(devices: &[Device]) -> Result<(), EnforceError> {
    let mut seen: BTreeMap<&str, Option<MpsTarget>> = BTreeMap::new();
    for device in devices {
        let request = device.resolved.selected.request.as_str();
        let mine = limits(device).map(|_| target(&device.resolved));
        if seen.get(request).is_some_and(|first| *first != mine) {
            return Err(EnforceError::Request {
                request: request.to_owned(),
                problem: format!(
                    "request {request} has devices that would need different MPS daemons (or \
                     some under MPS and some not); a CUDA process can use one MPS daemon only"
                ),
                fix: Some(
                    "split the request into one request per GPU, or do not combine MPS and \
                     non-MPS devices"
                        .into(),
                ),
            });
        }
        seen.insert(request, mine);
    }
    Ok(())
}

pub struct Mps {
    host: Arc<dyn MpsControl>,
}

impl Mps {
    pub fn new(host: Arc<dyn MpsControl>) -> Self {
        Mps { host }
    }
}

impl Enforcer for Mps {
    /// One action per daemon. A dynamic MIG device's UUID is not known yet:
    /// [`Enforcer::apply`] fills it in, recorded, before the daemon starts.
    fn plan(&self, devices: &[Device]) -> Vec<Action> {
        daemons(devices)
            .into_keys()
            .map(|t| Action::Mps {
                gpu_uuid: t.gpu_uuid,
                mig_uuid: t.mig_uuid,
                request: Some(t.request),
            })
            .collect()
    }

    fn apply(&self, cx: &mut Effects<'_>, devices: &mut [Device]) -> Result<bool, EnforceError> {
        one_daemon_per_request(devices)?;
        let daemons = daemons(devices);
        if !daemons.is_empty() && !cx.may_block() {
            return Err(EnforceError::WouldBlock);
        }
        for (target, wanted) in daemons {
            if record_target(cx, &target) {
                cx.record()?;
            }
            let device = target.mig_uuid.as_ref().unwrap_or(&target.gpu_uuid);
            let client = self
                .host
                .acquire(cx.uid, &target, &wanted.limits, wanted.gpu_minor)
                .map_err(EnforceError::host(format!(
                    "start MPS for request {} on {device}",
                    target.request
                )))?;
            for d in devices.iter_mut() {
                if d.mps.is_none()
                    && self::limits(d).is_some()
                    && self::target(&d.resolved) == target
                {
                    d.mps = Some(client.clone());
                }
            }
        }
        Ok(false)
    }

    fn undo(&self, cx: &Undo<'_>, action: &Action) -> Option<Result<(), EnforceError>> {
        let Action::Mps {
            gpu_uuid,
            mig_uuid,
            request,
        } = action
        else {
            return None;
        };
        // Without a request: a shared daemon of an earlier version, retired
        // by the supervisor; nothing of this claim's own.
        let request = request.as_ref()?;
        let target = MpsTarget {
            request: request.clone(),
            gpu_uuid: gpu_uuid.clone(),
            mig_uuid: mig_uuid.clone(),
        };
        Some(
            self.host
                .release(cx.uid, &target)
                .map_err(EnforceError::host(format!(
                    "stop the MPS daemon of request {request} on {}",
                    mig_uuid.as_ref().unwrap_or(gpu_uuid)
                ))),
        )
    }

    fn edits(&self, request: &Request<'_>, edits: &mut ContainerEdits) -> Result<(), EnforceError> {
        // One daemon per request (checked before it started).
        let Some(client) = request.devices.iter().find_map(|d| d.mps.as_ref()) else {
            return Ok(());
        };
        edits.env.push(format!(
            "CUDA_MPS_PIPE_DIRECTORY={}",
            client.pipe_dir.display()
        ));
        // The daemon's own limits, again where the client reads them.
        let limits = crate::host::mps_client::ClientLimits {
            memory_bytes: client.limits.memory_bytes,
            thread_percent: client.limits.compute_percent,
            shm_bytes: client.limits.shared_memory_bytes,
        };
        let env = crate::host::mps_client::client_limit_env(&request.visible[0], limits).map_err(
            |e| EnforceError::Request {
                request: request.name.to_owned(),
                problem: e.to_string(),
                fix: None,
            },
        )?;
        edits.env.extend(env);
        // The pipe directory, and the daemon's /dev/shm where the server
        // and its clients share memory; the daemon's logs stay on the host.
        let pipe = client.pipe_dir.to_string_lossy().into_owned();
        let shm = client.shm_dir.to_string_lossy().into_owned();
        for (host_path, container_path) in [(pipe.clone(), pipe), (shm, "/dev/shm".to_owned())] {
            edits.mounts.push(Mount {
                host_path,
                container_path,
                options: crate::host::mps_client::PIPE_MOUNT_OPTIONS
                    .map(String::from)
                    .to_vec(),
                mount_type: None,
            });
        }
        Ok(())
    }

    fn describe(&self, device: &Device, data: &mut DeviceData) {
        if let Some(l) = limits(device) {
            data.limits = Some(LimitsData::from(&l));
        }
        if let Kind::Share {
            level: IsolationLevel::Isolated,
            provider: None | Some(IsolationProvider::Mps),
            ..
        } = device.resolved.kind
        {
            data.isolation_provider = Some(IsolationProvider::Mps.as_str().to_owned());
        }
    }
}

/// Points the claim's recorded action for `target` at its device: a
/// dynamic MIG device's UUID exists only now, and two MIG devices of one
/// GPU in a request were planned as one action. Whether the entry changed.
fn record_target(cx: &mut Effects<'_>, target: &MpsTarget) -> bool {
    let matches = |a: &Action, mig: Option<&String>| {
        matches!(a, Action::Mps { gpu_uuid, mig_uuid, request: Some(r) }
            if *gpu_uuid == target.gpu_uuid && *r == target.request && mig_uuid.as_ref() == mig)
    };
    if cx
        .entry
        .actions
        .iter()
        .any(|a| matches(a, target.mig_uuid.as_ref()))
    {
        return false;
    }
    let action = Action::Mps {
        gpu_uuid: target.gpu_uuid.clone(),
        mig_uuid: target.mig_uuid.clone(),
        request: Some(target.request.clone()),
    };
    match cx.entry.actions.iter_mut().find(|a| matches(a, None)) {
        Some(planned) => *planned = action,
        None => cx.entry.actions.push(action),
    }
    true
}
