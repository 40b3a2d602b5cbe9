//! MIG: the MIG mode of GPUs whose mode the driver manages, MIG devices
//! created for a claim (dynamic MIG), and the capability nodes a container
//! needs to use a MIG device.
//!
//! Every change is made under the node's hardware lock and recorded before
//! it is made (a created device again right after, with what NVML made), so
//! a crash at any point leaves a record that says what to undo. A GPU's MIG
//! mode is held by every claim that needs it; once no claim holds it and no
//! MIG device is on it, it goes back to MIG off ([`Mig::settle`]).

use std::sync::{Arc, RwLock};

use tessera_api::inventory::MigPlacement;

use tracing::{info, warn};

use super::mig_caps;
use super::whole::push_node;
use super::{Device, Effects, EnforceError, Enforcer, Report, Request, Undo};
use crate::cdi::ContainerEdits;
use crate::claim_uid::ClaimUid;
use crate::host::port::{CreateError, MigManager};
use crate::prepare::resolve::Kind;
use crate::state::checkpoint::Checkpoint;
use crate::state::records::{Action, ClaimEntry, MigRecord};
use crate::sync::ReadWrite;

pub struct Mig {
    host: Arc<dyn MigManager>,
}

impl Mig {
    pub fn new(host: Arc<dyn MigManager>) -> Self {
        Mig { host }
    }

    /// Puts each device's GPU in the MIG mode it needs, holding it.
    fn hold_modes(&self, cx: &mut Effects<'_>, devices: &[Device]) -> Result<bool, EnforceError> {
        let mut changed = false;
        for device in devices {
            let Some(enabled) = device.resolved.mig_mode else {
                continue;
            };
            let gpu = &device.resolved.gpu.uuid;
            let current = self
                .host
                .mig_enabled(gpu)
                .map_err(EnforceError::host(format!(
                    "read the MIG mode of GPU {gpu}"
                )))?;
            if current != enabled && !cx.may_block() {
                return Err(EnforceError::WouldBlock);
            }
            if !cx.entry.mig_mode_holds().any(|g| g == gpu) {
                cx.entry.actions.push(Action::MigMode {
                    gpu_uuid: gpu.clone(),
                    enabled,
                });
                // Other claims must see the hold before the lock is
                // released; it must be durable only before a switch (one to
                // roll back). Otherwise the claim's completion writes it.
                if current == enabled {
                    cx.stage();
                } else {
                    cx.record()?;
                }
            }
            if current != enabled {
                self.host
                    .set_mig_mode(gpu, enabled)
                    .map_err(EnforceError::host(format!(
                        "prepare device {}",
                        device.resolved.selected.device
                    )))?;
                info!(claim = %cx.claim, gpu = %gpu, enabled, "switched MIG mode");
                changed = true;
            }
        }
        Ok(changed)
    }

    /// Creates the claim's dynamic MIG devices, each recorded before NVML
    /// is asked and again with what it made.
    fn create(&self, cx: &mut Effects<'_>, devices: &mut [Device]) -> Result<bool, EnforceError> {
        let mut changed = false;
        for device in devices.iter_mut() {
            let resolved = &mut device.resolved;
            let Kind::Mig {
                instance,
                create: Some((profile_id, placement)),
                ..
            } = &mut resolved.kind
            else {
                continue;
            };
            let gpu = resolved.gpu.uuid.clone();
            let cannot = EnforceError::host(format!(
                "create MIG device {} on GPU {gpu}",
                resolved.selected.device
            ));
            if let Err(e) = self.host.check_free(&gpu, *profile_id, *placement) {
                return Err(cannot(e));
            }
            cx.entry.actions.push(Action::MigCreate {
                gpu_uuid: gpu.clone(),
                profile_id: *profile_id,
                placement: *placement,
                instance: None,
            });
            cx.record()?;
            let created = match self.host.create(&gpu, *profile_id, *placement) {
                Ok(created) => created,
                Err(CreateError::NothingMade(e)) => {
                    // Nothing of ours is there: the intent goes, so that no
                    // rollback takes what another actor made at the
                    // placement meanwhile (NVML refused ours) for ours.
                    cx.entry.actions.retain(|a| !is_intent(a, &gpu, *placement));
                    cx.record()?;
                    return Err(cannot(e));
                }
                // The intent stays; its undo leaves the remains alone and
                // the error names them.
                Err(CreateError::LeftBehind(e)) => return Err(cannot(e)),
            };
            for action in cx.entry.actions.iter_mut() {
                if let Action::MigCreate {
                    gpu_uuid,
                    placement: at,
                    instance: recorded @ None,
                    ..
                } = action
                    && *gpu_uuid == gpu
                    && at == placement
                {
                    *recorded = Some(MigRecord {
                        gpu_instance_id: created.gpu_instance_id,
                        compute_instance_id: created.compute_instance_id,
                        mig_uuid: created.uuid.clone(),
                    });
                }
            }
            *instance = Some(created);
            cx.record()?;
            changed = true;
        }
        Ok(changed)
    }

    /// Only the intent to create was recorded: the node process stopped
    /// between asking NVML and recording its answer, or a failed create
    /// could not remove what it made. NVML cannot say who made an instance,
    /// and another actor may have made one at the placement since the free
    /// check, so whatever is there is left alone and reported.
    fn leave_unproven(&self, cx: &Undo<'_>, gpu: &str, profile_id: u32, placement: MigPlacement) {
        let _hardware = cx.hardware();
        if let Err(there) = self.host.check_free(gpu, profile_id, placement) {
            cx.report(Report {
                reason: "MigDeviceLeftAlone",
                action: format!(
                    "LeaveMigDevice {gpu} {}:{}",
                    placement.start, placement.size
                ),
                message: format!(
                    "claim {}: it was creating a MIG device (profile {profile_id}) at {}:{} on GPU \
                     {gpu} when it was interrupted, and cannot tell whether what is there now is \
                     its own: {there}. Left alone. Fix: if no workload uses it, destroy it \
                     (nvidia-smi mig -lgi lists it; nvidia-smi mig -dci then -dgi with its -gi id)",
                    cx.uid, placement.start, placement.size
                ),
            });
        }
    }

    /// GPUs whose MIG mode the driver manages go back to MIG off once no
    /// claim holds them and no MIG device is on them. Returns the problems
    /// and whether a GPU was switched.
    pub fn settle<'a>(
        &self,
        records: &Checkpoint<ClaimEntry>,
        hardware: &RwLock<()>,
        gpus: impl IntoIterator<Item = &'a str>,
    ) -> (Vec<String>, bool) {
        let mut gpus = gpus.into_iter().peekable();
        if gpus.peek().is_none() {
            return (Vec::new(), false);
        }
        let _hardware = hardware.writing();
        // Lost records' holds count too: their Pods may still run.
        let lost = records.lost();
        let held = |gpu: &str| {
            (records.lock().values())
                .chain(lost.claims.values().flatten())
                .any(|e| e.mig_mode_holds().any(|g| g == gpu))
        };
        let mut problems = Vec::new();
        let mut switched = false;
        for gpu in gpus.filter(|g| !held(g)) {
            let idle_on = self
                .host
                .mig_enabled(gpu)
                .and_then(|on| Ok(on && !self.host.has_instances(gpu)?));
            match idle_on {
                Ok(false) => {}
                Ok(true) => match self.host.set_mig_mode(gpu, false) {
                    Ok(()) => {
                        info!(gpu = %gpu, "switched MIG mode off (no claim holds the GPU)");
                        switched = true;
                    }
                    Err(e) => problems.push(format!("switching MIG mode off on {gpu}: {e}")),
                },
                Err(e) => problems.push(format!("reading the MIG mode of {gpu}: {e}")),
            }
        }
        for p in &problems {
            warn!("{p}");
        }
        (problems, switched)
    }
}

impl Enforcer for Mig {
    fn apply(&self, cx: &mut Effects<'_>, devices: &mut [Device]) -> Result<bool, EnforceError> {
        let changes_gpus = devices.iter().any(|d| {
            d.resolved.mig_mode.is_some()
                || matches!(
                    d.resolved.kind,
                    Kind::Mig {
                        create: Some(_),
                        ..
                    }
                )
        });
        if !changes_gpus {
            return Ok(false);
        }
        let creates = devices.iter().any(|d| {
            matches!(
                d.resolved.kind,
                Kind::Mig {
                    create: Some(_),
                    ..
                }
            )
        });
        if creates && !cx.may_block() {
            return Err(EnforceError::WouldBlock);
        }
        let _hardware = cx.hardware();
        let switched = self.hold_modes(cx, devices)?;
        let created = self.create(cx, devices)?;
        Ok(switched || created)
    }

    fn undo(&self, cx: &Undo<'_>, action: &Action) -> Option<Result<(), EnforceError>> {
        match action {
            // The hold goes with the record; settled once it is gone.
            Action::MigMode { .. } => Some(Ok(())),
            Action::MigCreate {
                gpu_uuid,
                profile_id,
                placement,
                instance: Some(recorded),
            } => {
                let _hardware = cx.hardware();
                Some(
                    self.host
                        .destroy(gpu_uuid, *profile_id, *placement, recorded)
                        .map_err(EnforceError::host(format!(
                            "destroy the MIG device at {placement:?} on GPU {gpu_uuid}"
                        ))),
                )
            }
            Action::MigCreate {
                gpu_uuid,
                profile_id,
                placement,
                instance: None,
            } => {
                self.leave_unproven(cx, gpu_uuid, *profile_id, *placement);
                Some(Ok(()))
            }
            _ => None,
        }
    }

    fn released(&self, cx: &Undo<'_>, entry: &ClaimEntry) -> bool {
        self.settle(cx.records, cx.hardware, entry.mig_mode_holds())
            .1
    }

    /// Recorded MIG devices of a prepared claim that NVML no longer has.
    fn check(&self, uid: &ClaimUid, entry: &ClaimEntry) -> Vec<String> {
        let mut problems = Vec::new();
        for action in &entry.actions {
            let Action::MigCreate {
                gpu_uuid,
                instance: Some(record),
                ..
            } = action
            else {
                continue;
            };
            match self.host.exists(gpu_uuid, record) {
                Ok(true) => {}
                Ok(false) => problems.push(format!(
                    "claim {}/{} (uid {uid}): its MIG device {} on GPU {gpu_uuid} is gone (GPU \
                     reset or removed by hand); its containers cannot use it: delete its Pod",
                    entry.namespace, entry.name, record.mig_uuid
                )),
                Err(e) => problems.push(format!(
                    "claim {uid}: cannot check its MIG device {}: {e}",
                    record.mig_uuid
                )),
            }
        }
        problems
    }

    /// The GPU instance and compute instance capability nodes of each MIG
    /// device, made where the driver did not.
    fn edits(&self, request: &Request<'_>, edits: &mut ContainerEdits) -> Result<(), EnforceError> {
        let layout = request.layout;
        for device in &request.devices {
            let resolved = &device.resolved;
            let Some(instance) = resolved.mig_instance() else {
                continue;
            };
            let caps = mig_caps::read(
                &layout.driver_root,
                resolved.gpu.minor,
                instance.gpu_instance_id,
                instance.compute_instance_id,
            )
            .map_err(|e| EnforceError::Device {
                index: resolved.selected.index,
                problem: e.to_string(),
                fix: None,
            })?;
            for minor in [caps.gpu_instance, caps.compute_instance] {
                let node = mig_caps::device_path(minor);
                mig_caps::ensure_node(&layout.dev_root, &layout.driver_root, &node, minor)
                    .map_err(|e| EnforceError::Node {
                        problem: e.to_string(),
                        fix: "load the NVIDIA driver with MIG support, or point --dev-root at \
                              a writable /dev"
                            .into(),
                    })?;
                push_node(request, edits, node);
            }
        }
        Ok(())
    }
}

/// The recorded intent to create a MIG device at `placement` on `gpu`, not
/// yet followed by what NVML made.
fn is_intent(action: &Action, gpu: &str, placement: MigPlacement) -> bool {
    matches!(action, Action::MigCreate { gpu_uuid, placement: at, instance: None, .. }
        if gpu_uuid == gpu && *at == placement)
}
