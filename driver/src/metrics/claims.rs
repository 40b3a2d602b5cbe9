//! GPU use per claim: the processes NVML lists, mapped to their Pods
//! through the node's cgroups, and the Pods to the claims prepared here.
//!
//! NVML reports host pids; `/proc/<pid>/cgroup` of such a process names its
//! Pod's cgroup, which carries the Pod's UID (cgroupfs driver:
//! `.../pod<uid>/<container>`; systemd driver:
//! `...-pod<uid with underscores>.slice/...`; cgroup v1 and v2 alike). A
//! kubelet that makes no Pod cgroups (`cgroupsPerQOS: false`) leaves the
//! UID to the files it bind-mounts into every container from the Pod's
//! directory (`<kubelet root>/pods/<uid>/...` at `/etc/hosts` and
//! `/dev/termination-log`, in `/proc/<pid>/mountinfo`). So the node process
//! must see the host's pids (`hostPID: true` in the chart); without it no
//! process resolves and every claim reads 0.
//!
//! A claim's consumers are the Pods it was reserved for when it was
//! prepared (kept in memory by the preparer, never in the claim's record,
//! so records stay readable by the version a rollback goes back to). A Pod
//! that none of them names but whose process uses a GPU a prepared claim
//! holds (a shared claim reserved for more Pods after its first prepare, or
//! any claim after the node process restarted) makes the node process read
//! those claims again from the API server, at most once every
//! [`REFRESH_EVERY`] per claim; the next render counts it.
//!
//! Labels stay bounded: one series per claim and GPU it holds (never per
//! process), gone with the claim.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tracing::debug;

use super::gpus::GpuReading;
use crate::claim_uid::ClaimUid;
use crate::prepare::claims::{ClaimSource, FetchError};
use crate::state::records::{ClaimEntry, EntryState};
use crate::sync::Locked;

/// The shortest time between two reads of one claim's consumers.
pub const REFRESH_EVERY: Duration = Duration::from_secs(10);
/// Claim reads waiting for the reader at most: while the API server is slow
/// the rest are asked at a later render, not queued without bound.
const REFRESH_QUEUE: usize = 256;

/// A claim on one GPU: the labels of its series.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ClaimGpu {
    pub namespace: String,
    pub name: String,
    pub gpu: String,
}

/// What a claim's processes use on one GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClaimUse {
    pub memory_bytes: u64,
    /// Sum of its processes' SM percent; `None` where NVML gives no
    /// per-process samples.
    pub sm_percent: Option<u32>,
}

/// The Pod UID in a process's `/proc/<pid>/cgroup` text, if it runs in a
/// Kubernetes Pod.
pub fn pod_in_cgroup(text: &str) -> Option<String> {
    text.lines()
        .filter_map(|line| line.splitn(3, ':').nth(2))
        .flat_map(|path| path.split('/'))
        .find_map(pod_in_segment)
}

/// `pod<uid>` (cgroupfs) or `kubepods-<qos>-pod<uid_with_underscores>.slice`
/// (systemd).
fn pod_in_segment(segment: &str) -> Option<String> {
    let raw = match segment.strip_suffix(".slice") {
        Some(slice) => slice.rsplit_once("-pod")?.1,
        None => segment.strip_prefix("pod")?,
    };
    let uid = raw.replace('_', "-");
    let well_formed = uid.len() == 36
        && uid.chars().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_hexdigit(),
        });
    well_formed.then_some(uid)
}

/// The Pod UID in a process's `/proc/<pid>/mountinfo`: the source of the
/// files the kubelet mounts from the Pod's directory.
pub fn pod_in_mountinfo(text: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let mut fields = line.split(' ');
        let root = fields.nth(3)?;
        let mount_point = fields.next()?;
        if !matches!(mount_point, "/etc/hosts" | "/dev/termination-log") {
            return None;
        }
        let mut segments = root.split('/');
        segments.find(|s| *s == "pods")?;
        segments
            .next()
            .and_then(|uid| pod_in_segment(&format!("pod{uid}")))
    })
}

/// The Pod of host process `pid`: from `<proc>/<pid>/cgroup`, else from
/// the kubelet's mounts in `<proc>/<pid>/mountinfo`.
pub fn pod_of(proc: &Path, pid: u32) -> Option<String> {
    let dir = proc.join(pid.to_string());
    let read = |name| std::fs::read_to_string(dir.join(name)).ok();
    read("cgroup")
        .and_then(|t| pod_in_cgroup(&t))
        .or_else(|| read("mountinfo").and_then(|t| pod_in_mountinfo(&t)))
}

/// Whether `entry` holds the device a process runs on (`device`: a GPU or
/// MIG UUID) on `gpu`.
fn holds(entry: &ClaimEntry, gpu: &str, device: &str) -> bool {
    entry.status.iter().any(|d| {
        d.data.gpu_uuid == gpu
            && match d.data.mig_uuid.as_deref() {
                Some(mig) => mig == device,
                None => true,
            }
    })
}

/// Per claim and GPU it holds, what its Pods' processes use; and the
/// claims to read again because a Pod none of them names uses a GPU they
/// hold.
pub fn attribute(
    entries: &[(ClaimUid, ClaimEntry)],
    consumers: &BTreeMap<String, Vec<String>>,
    readings: &[GpuReading],
    pod_of: impl Fn(u32) -> Option<String>,
) -> (BTreeMap<ClaimGpu, ClaimUse>, BTreeSet<ClaimUid>) {
    let completed: Vec<&(ClaimUid, ClaimEntry)> = entries
        .iter()
        .filter(|(_, e)| e.state == EntryState::Completed)
        .collect();
    let sampled: BTreeMap<&str, &BTreeMap<u32, u32>> = readings
        .iter()
        .filter_map(|r| Some((r.uuid.as_str(), r.sm_percent.as_ref()?)))
        .collect();
    let mut uses = BTreeMap::new();
    for (_, e) in &completed {
        for d in &e.status {
            let gpu = d.data.gpu_uuid.as_str();
            uses.insert(
                key(e, gpu),
                ClaimUse {
                    memory_bytes: 0,
                    sm_percent: sampled.contains_key(gpu).then_some(0),
                },
            );
        }
    }
    let mut stale = BTreeSet::new();
    for r in readings {
        for p in &r.processes {
            let on: Vec<_> = completed
                .iter()
                .filter(|(_, e)| holds(e, &r.uuid, &p.device))
                .collect();
            if on.is_empty() {
                continue;
            }
            let Some(pod) = pod_of(p.pid) else {
                continue;
            };
            let consumer = on.iter().find(|(uid, _)| {
                consumers
                    .get(uid.as_str())
                    .is_some_and(|pods| pods.contains(&pod))
            });
            let Some((_, e)) = consumer else {
                stale.extend(on.iter().map(|(uid, _)| uid.clone()));
                continue;
            };
            let u = uses.entry(key(e, &r.uuid)).or_default();
            u.memory_bytes += p.memory_bytes;
            if let (Some(sm), Some(samples)) = (u.sm_percent.as_mut(), sampled.get(r.uuid.as_str()))
            {
                *sm += samples.get(&p.pid).copied().unwrap_or(0);
            }
        }
    }
    (uses, stale)
}

fn key(e: &ClaimEntry, gpu: &str) -> ClaimGpu {
    ClaimGpu {
        namespace: e.namespace.clone(),
        name: e.name.clone(),
        gpu: gpu.to_owned(),
    }
}

/// Consumers read from the API server after prepare, by claim UID.
pub struct Consumers {
    known: Mutex<BTreeMap<String, Vec<String>>>,
    asked: Mutex<BTreeMap<ClaimUid, Instant>>,
    requests: mpsc::Sender<(ClaimUid, String, String)>,
}

impl Consumers {
    /// Starts the task that reads claims from `source` (on the current
    /// runtime: never on the render thread).
    pub fn spawn(source: Arc<dyn ClaimSource>) -> Arc<Consumers> {
        let (requests, mut asked) = mpsc::channel::<(ClaimUid, String, String)>(REFRESH_QUEUE);
        let consumers = Arc::new(Consumers {
            known: Mutex::default(),
            asked: Mutex::default(),
            requests,
        });
        let weak = Arc::downgrade(&consumers);
        tokio::spawn(async move {
            while let Some((uid, namespace, name)) = asked.recv().await {
                let read = source.get(&namespace, &name).await;
                let Some(consumers) = weak.upgrade() else {
                    return;
                };
                match read {
                    Ok(claim) if claim.metadata.uid.as_deref() == Some(uid.as_str()) => {
                        let pods = crate::prepare::consumers(&claim);
                        consumers.lock_known().insert(uid.as_str().to_owned(), pods);
                    }
                    Ok(_) | Err(FetchError::NotFound) => {
                        consumers.lock_known().remove(uid.as_str());
                    }
                    Err(FetchError::Failed(e)) => {
                        debug!("reading claim {namespace}/{name} for its consumers: {e}");
                    }
                }
            }
        });
        consumers
    }

    fn lock_known(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Vec<String>>> {
        self.known.locked()
    }

    /// What was read so far, for the claims still prepared (the others
    /// are forgotten).
    pub fn known(&self, entries: &[(ClaimUid, ClaimEntry)]) -> BTreeMap<String, Vec<String>> {
        let prepared: BTreeSet<&str> = entries.iter().map(|(uid, _)| uid.as_str()).collect();
        let mut known = self.lock_known();
        known.retain(|uid, _| prepared.contains(uid.as_str()));
        known.clone()
    }

    /// Asks for `stale` claims to be read again, each at most once every
    /// [`REFRESH_EVERY`].
    pub fn refresh(&self, stale: BTreeSet<ClaimUid>, entries: &[(ClaimUid, ClaimEntry)]) {
        let now = Instant::now();
        let mut asked = self.asked.locked();
        asked.retain(|_, at| now.duration_since(*at) < REFRESH_EVERY);
        for uid in stale {
            if asked.contains_key(&uid) {
                continue;
            }
            let Some((_, e)) = entries.iter().find(|(u, _)| *u == uid) else {
                continue;
            };
            let request = (uid.clone(), e.namespace.clone(), e.name.clone());
            if self.requests.try_send(request).is_err() {
                // Full: not asked, so a later render asks again.
                break;
            }
            asked.insert(uid, now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::gpus::ProcessUse;
    use crate::state::records::{DeviceData, DeviceStatus};

    const POD: &str = "0f3c1d2e-4b5a-4c6d-8e7f-9a0b1c2d3e4f";
    const LATER_POD: &str = "11111111-2222-4333-8444-555555555555";

    /// A claim source that never answers (an API server that hangs).
    struct Hanging;

    impl ClaimSource for Hanging {
        fn get<'a>(&'a self, _: &'a str, _: &'a str) -> crate::prepare::claims::FetchFuture<'a> {
            Box::pin(std::future::pending())
        }
    }

    #[tokio::test]
    async fn refreshes_wait_in_a_bounded_queue_and_the_rest_are_asked_later() {
        let consumers = Consumers::spawn(Arc::new(Hanging));
        let entries: Vec<(ClaimUid, ClaimEntry)> = (0..4 * REFRESH_QUEUE)
            .map(|n| {
                let uid = ClaimUid::parse(&format!("{n:08x}-0000-4000-8000-000000000000"));
                let entry = ClaimEntry {
                    namespace: "ns".into(),
                    name: format!("c{n}"),
                    state: EntryState::Completed,
                    actions: Vec::new(),
                    devices: Vec::new(),
                    spec: None,
                    status: Vec::new(),
                    ahead: false,
                };
                (uid.unwrap(), entry)
            })
            .collect();
        let stale: BTreeSet<ClaimUid> = entries.iter().map(|(u, _)| u.clone()).collect();
        consumers.refresh(stale.clone(), &entries);
        let asked = consumers.asked.lock().unwrap().len();
        assert_eq!(asked, REFRESH_QUEUE, "queued at most the bound");
        // The reader takes one (and hangs on it): the next render asks one
        // of the claims not yet asked.
        let deadline = Instant::now() + Duration::from_secs(10);
        while consumers.requests.capacity() == 0 {
            assert!(Instant::now() < deadline, "the reader never took a request");
            tokio::task::yield_now().await;
        }
        consumers.refresh(stale, &entries);
        assert_eq!(consumers.asked.lock().unwrap().len(), REFRESH_QUEUE + 1);
    }

    #[test]
    fn pods_are_found_in_cgroupfs_and_systemd_paths_v1_and_v2() {
        let systemd_v2 = "0::/kubepods.slice/kubepods-besteffort.slice/\
             kubepods-besteffort-pod0f3c1d2e_4b5a_4c6d_8e7f_9a0b1c2d3e4f.slice/\
             cri-containerd-abc.scope\n";
        let cgroupfs_v2 = "0::/kubepods/burstable/pod0f3c1d2e-4b5a-4c6d-8e7f-9a0b1c2d3e4f/abc\n";
        let guaranteed_v1 = "12:memory:/kubepods/pod0f3c1d2e-4b5a-4c6d-8e7f-9a0b1c2d3e4f/abc\n\
             11:cpu,cpuacct:/kubepods/pod0f3c1d2e-4b5a-4c6d-8e7f-9a0b1c2d3e4f/abc\n\
             1:name=systemd:/\n";
        for text in [systemd_v2, cgroupfs_v2, guaranteed_v1] {
            assert_eq!(pod_in_cgroup(text).as_deref(), Some(POD), "{text}");
        }
        for text in [
            "0::/user.slice/user-0.slice/session-1.scope\n",
            "0::/system.slice/podman.service\n",
            "0::/kubepods/podnot-a-uid/abc\n",
            "",
        ] {
            assert_eq!(pod_in_cgroup(text), None, "{text}");
        }
    }

    #[test]
    fn pods_are_found_in_the_kubelet_mounts_without_pod_cgroups() {
        let mountinfo = "\
            600 500 0:50 / / rw,relatime - overlay overlay rw\n\
            610 600 8:1 /var/lib/kubelet/pods/0f3c1d2e-4b5a-4c6d-8e7f-9a0b1c2d3e4f/etc-hosts \
            /etc/hosts rw,relatime - ext4 /dev/sda1 rw\n\
            611 600 8:1 /var/lib/kubelet/pods/0f3c1d2e-4b5a-4c6d-8e7f-9a0b1c2d3e4f/containers/main/1a2b \
            /dev/termination-log rw,relatime - ext4 /dev/sda1 rw\n";
        assert_eq!(pod_in_mountinfo(mountinfo).as_deref(), Some(POD));
        // A hostPath volume of the kubelet's directory names no Pod.
        let volume = "612 600 8:1 /var/lib/kubelet/pods /host-pods rw - ext4 /dev/sda1 rw\n";
        assert_eq!(pod_in_mountinfo(volume), None);
        assert_eq!(pod_in_mountinfo(""), None);
    }

    fn entry(name: &str, gpu: &str, mig: Option<&str>) -> ClaimEntry {
        ClaimEntry {
            namespace: "ns".into(),
            name: name.into(),
            state: EntryState::Completed,
            actions: Vec::new(),
            devices: Vec::new(),
            spec: None,
            status: vec![DeviceStatus {
                pool: "node".into(),
                device: "dev".into(),
                share_id: None,
                data: DeviceData {
                    device_type: if mig.is_some() { "mig" } else { "gpu" }.into(),
                    gpu_uuid: gpu.into(),
                    mig_uuid: mig.map(Into::into),
                    profile: None,
                    isolation_level: None,
                    sharing: None,
                    time_slice: None,
                    limits: None,
                    consumed: None,
                    isolation_provider: None,
                },
                conditions: Vec::new(),
            }],
            ahead: false,
        }
    }

    /// Pods per claim, as the preparer keeps them.
    fn consumers(of: &[(ClaimUid, &[&str])]) -> BTreeMap<String, Vec<String>> {
        of.iter()
            .map(|(uid, pods)| {
                let pods = pods.iter().map(|p| p.to_string()).collect();
                (uid.as_str().to_owned(), pods)
            })
            .collect()
    }

    fn uid(n: u8) -> ClaimUid {
        ClaimUid::parse(&format!("00000000-0000-4000-8000-0000000000{n:02}")).unwrap()
    }

    fn process(pid: u32, device: &str, memory_bytes: u64) -> ProcessUse {
        ProcessUse {
            pid,
            device: device.into(),
            memory_bytes,
        }
    }

    #[test]
    fn processes_count_for_the_claim_their_pod_consumes() {
        let entries = vec![
            (uid(1), entry("whole", "GPU-a", None)),
            (uid(2), entry("mig", "GPU-b", Some("MIG-1"))),
            (uid(3), entry("idle", "GPU-c", None)),
        ];
        let known = consumers(&[(uid(1), &[POD]), (uid(2), &[POD]), (uid(3), &[])]);
        let readings = vec![
            GpuReading {
                uuid: "GPU-a".into(),
                processes: vec![process(10, "GPU-a", 1 << 30), process(11, "GPU-a", 1 << 20)],
                sm_percent: Some([(10, 60)].into_iter().collect()),
                ..GpuReading::default()
            },
            GpuReading {
                uuid: "GPU-b".into(),
                // One on the claim's MIG device, one on another.
                processes: vec![process(12, "MIG-1", 2 << 30), process(13, "MIG-2", 4 << 30)],
                sm_percent: None,
                ..GpuReading::default()
            },
        ];
        // 11 runs outside any Pod.
        let pods = |pid| (pid != 11).then(|| POD.to_owned());
        let (uses, stale) = attribute(&entries, &known, &readings, pods);
        let get = |name: &str, gpu: &str| {
            uses.get(&ClaimGpu {
                namespace: "ns".into(),
                name: name.into(),
                gpu: gpu.into(),
            })
            .cloned()
        };
        assert_eq!(
            get("whole", "GPU-a"),
            Some(ClaimUse {
                memory_bytes: 1 << 30,
                sm_percent: Some(60)
            })
        );
        assert_eq!(
            get("mig", "GPU-b"),
            Some(ClaimUse {
                memory_bytes: 2 << 30,
                sm_percent: None
            })
        );
        assert_eq!(get("idle", "GPU-c"), Some(ClaimUse::default()));
        assert_eq!(uses.len(), 3);
        assert!(stale.is_empty());
    }

    #[test]
    fn a_pod_no_claim_names_asks_for_the_claims_on_its_gpu_until_read() {
        let entries = vec![(uid(1), entry("shared", "GPU-a", None))];
        let at_prepare = consumers(&[(uid(1), &[POD])]);
        let readings = vec![GpuReading {
            uuid: "GPU-a".into(),
            processes: vec![process(20, "GPU-a", 1 << 30)],
            ..GpuReading::default()
        }];
        let pods = |_| Some(LATER_POD.to_owned());
        let (uses, stale) = attribute(&entries, &at_prepare, &readings, pods);
        assert_eq!(stale, [uid(1)].into_iter().collect());
        assert_eq!(uses.values().map(|u| u.memory_bytes).sum::<u64>(), 0);
        let read = consumers(&[(uid(1), &[POD, LATER_POD])]);
        let (uses, stale) = attribute(&entries, &read, &readings, pods);
        assert!(stale.is_empty());
        assert_eq!(uses.values().map(|u| u.memory_bytes).sum::<u64>(), 1 << 30);
    }
}
