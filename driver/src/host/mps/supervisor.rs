//! The MPS control daemons of a node: one per request of an Isolated claim
//! (or an MPS config) on each device it holds, started at prepare with the
//! claim's limits as the daemon's defaults, adopted after a driver restart,
//! restarted (in a fresh pipe directory) if it died, and stopped at
//! unprepare. See [`super::daemon`] for one daemon's layout and what is
//! trusted.
//!
//! No daemon is shared between claims: a tenant that quits or tampers with
//! its daemon reaches only its own claim, and a daemon's limits are its
//! defaults for every client, not a request a client's environment makes.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::config::{MpsConfig, MpsError};
use super::daemon::{Daemon, DaemonKey, MpsDaemon, Outcome, written_before_this_boot};
use super::paths::{RECORD, ignore_missing};
use crate::claim_uid::ClaimUid;
use crate::host::mps_client::{ClientLimits, is_device_uuid};
use crate::host::process::{Pidfd, ProcessId};
use crate::sync::Locked;

/// What one supervision pass did.
#[derive(Debug, Default)]
pub struct SupervisionReport {
    /// Recorded daemons found running that this supervisor had not seen yet
    /// (after a driver restart).
    pub adopted: Vec<DaemonKey>,
    /// Daemons that were not running and were started again.
    pub restarted: Vec<DaemonKey>,
    /// Daemons of claims no longer prepared, stopped.
    pub stopped: Vec<DaemonKey>,
    /// Daemons that need attention, with why.
    pub failed: Vec<(String, MpsError)>,
}

impl SupervisionReport {
    fn merge(&mut self, other: SupervisionReport) {
        self.adopted.extend(other.adopted);
        self.restarted.extend(other.restarted);
        self.stopped.extend(other.stopped);
        self.failed.extend(other.failed);
    }

    /// In key order, whichever daemon finished first.
    fn sort(&mut self) {
        self.adopted.sort();
        self.restarted.sort();
        self.stopped.sort();
        self.failed.sort_by(|a, b| a.0.cmp(&b.0));
    }
}

/// Supervises the node's MPS control daemons, one per [`DaemonKey`].
///
/// Every method blocks (process spawns, polling with deadlines) and is safe
/// to call from several threads: calls for one daemon are serialized, calls
/// for different daemons run in parallel.
///
/// A daemon is forgotten (its map entry removed) while its own lock is
/// still held by whoever stopped it, and whoever takes that lock next
/// checks the entry is still its: a supervision pass that was waiting never
/// starts again a daemon that a release just stopped.
pub struct MpsSupervisor {
    config: MpsConfig,
    daemons: Mutex<BTreeMap<DaemonKey, Slot>>,
    /// Called by a supervision pass between finding a daemon and taking its
    /// lock, so that tests can stop it in that window.
    #[cfg(test)]
    before_lock: Mutex<Option<TestHook>>,
}

/// A daemon as the supervisor holds it.
struct Held {
    daemon: Daemon,
    /// To be stopped (a claim no longer prepared, a stop that failed): a
    /// supervision pass stops it rather than start it. `ensure` (a new
    /// prepare) clears it.
    released: bool,
}

type Slot = Arc<Mutex<Held>>;

#[cfg(test)]
type TestHook = Arc<dyn Fn(&DaemonKey) + Send + Sync>;

impl MpsSupervisor {
    /// A supervisor over `config.state_dir`. Nothing is started or stopped
    /// until a method is called; call [`MpsSupervisor::supervise`] at start
    /// to adopt daemons of a previous run and restart dead ones.
    pub fn new(config: MpsConfig) -> Self {
        MpsSupervisor {
            config,
            daemons: Mutex::new(BTreeMap::new()),
            #[cfg(test)]
            before_lock: Mutex::new(None),
        }
    }

    pub fn config(&self) -> &MpsConfig {
        &self.config
    }

    /// Make sure the daemon of `key` runs with `limits` as its defaults,
    /// seeing the GPU node `/dev/nvidia<gpu_minor>` only (every GPU node
    /// when `None`). Idempotent: a recorded daemon (after a driver restart)
    /// is adopted, a dead one is started again in a fresh pipe directory,
    /// and a new one is waited for until its control endpoint exists and
    /// it took the limits.
    pub fn ensure(
        &self,
        key: &DaemonKey,
        limits: ClientLimits,
        gpu_minor: Option<u32>,
    ) -> Result<MpsDaemon, MpsError> {
        self.with_daemon(key, Some(limits), |held| {
            held.released = false;
            let d = &mut held.daemon;
            // A running daemon keeps the view it started with; the next
            // start (and its control clients) take this one.
            d.record.gpu_minor = gpu_minor.or(d.record.gpu_minor);
            if d.record.limits != limits {
                // Prepared again with other limits (an earlier prepare was
                // rolled back): the running daemon has the old defaults. Take
                // hold of a daemon of an earlier run first, or it would be
                // adopted as it is.
                d.liveness()?;
                d.kill()?;
                d.record.limits = limits;
            }
            // A daemon started is recorded by its start, before anything of
            // it exists; a running one already is.
            match d.ensure_running(&self.config) {
                Ok(_) => Ok(d.info()),
                Err(e) => {
                    // Nothing half-made stays: the daemon error is the one
                    // to report.
                    let _ = self.retire(key, held);
                    Err(e)
                }
            }
        })?
        .expect("made when missing")
    }

    /// Stop the daemon of `key` (`quit`, then SIGKILL through the driver's
    /// handle if `quit` timed out) and remove its directory. Unknown keys
    /// succeed.
    pub fn release(&self, key: &DaemonKey) -> Result<(), MpsError> {
        if !is_device_uuid(&key.device) {
            // Nothing was ever started for it.
            return Ok(());
        }
        self.stop(key).map(|_| ())
    }

    /// Stop the daemons of every claim for which `keep` is false (a lost
    /// claim released at unprepare), now.
    pub fn retain_claims(&self, keep: impl Fn(&ClaimUid) -> bool) -> SupervisionReport {
        let mut report = SupervisionReport::default();
        for key in self.known_daemons(&mut report) {
            if keep(&key.claim) {
                continue;
            }
            match self.stop(&key) {
                Ok(true) => report.stopped.push(key),
                Ok(false) => {}
                Err(e) => report.failed.push((key.to_string(), e)),
            }
        }
        report
    }

    /// Stop a daemon and forget it; whether it was running.
    fn stop(&self, key: &DaemonKey) -> Result<bool, MpsError> {
        match self.with_daemon(key, None, |held| self.retire(key, held))? {
            Some(stopped) => stopped,
            None => Ok(false),
        }
    }

    /// Stop the daemon `held` (locked by the caller) and forget it while
    /// its lock is still held. A daemon that could not be stopped stays,
    /// released: the next supervision pass tries again, and never restarts
    /// it.
    fn retire(&self, key: &DaemonKey, held: &mut Held) -> Result<bool, MpsError> {
        held.released = true;
        let was_running = held.daemon.stop(&self.config)?;
        self.daemons.locked().remove(key);
        remove_if_empty(&self.config.state_dir.join(key.claim.as_str()));
        Ok(was_running)
    }

    /// Mark the daemons of every claim for which `keep` is false (claims
    /// the checkpoint does not know after a restart) to be stopped by the
    /// next supervision pass, which does it in the background. Unlike
    /// [`MpsSupervisor::retain_claims`], this waits on no daemon; a prepare
    /// of such a claim before that pass keeps its daemon. Call it before
    /// serving, then [`MpsSupervisor::spawn_watchdog`].
    pub fn release_claims_unless(&self, keep: impl Fn(&ClaimUid) -> bool) -> SupervisionReport {
        let mut report = SupervisionReport::default();
        for key in self.known_daemons(&mut report) {
            if keep(&key.claim) {
                continue;
            }
            if let Err(e) = self.with_daemon(&key, None, |held| held.released = true) {
                report.failed.push((key.to_string(), e));
            }
        }
        report
    }

    /// One supervision pass over every daemon this supervisor has a record
    /// of (on disk or in memory): adopt recorded daemons, restart dead
    /// ones and stop released ones. Each daemon is seen to on a thread of
    /// its own (a restart may wait up to the ready timeout, twice), so the
    /// pass takes as long as its slowest daemon, not their sum. Call it at
    /// start and periodically ([`MpsSupervisor::spawn_watchdog`]).
    pub fn supervise(&self) -> SupervisionReport {
        let mut report = SupervisionReport::default();
        let keys = self.known_daemons(&mut report);
        std::thread::scope(|scope| {
            let workers: Vec<_> = keys
                .iter()
                .map(|key| {
                    let work = || self.supervise_one(key);
                    (key, worker_thread().spawn_scoped(scope, work))
                })
                .collect();
            for (key, worker) in workers {
                let done = match worker {
                    Ok(worker) => worker
                        .join()
                        .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
                    // No thread to spare: see to it here.
                    Err(_) => self.supervise_one(key),
                };
                report.merge(done);
            }
        });
        report.sort();
        report
    }

    /// Adopt, restart or stop the daemon of `key`. A daemon someone else
    /// holds (a prepare, a release, an earlier pass still at it) is theirs
    /// to see to: it is skipped, so one slow daemon holds up no pass.
    fn supervise_one(&self, key: &DaemonKey) -> SupervisionReport {
        let mut report = SupervisionReport::default();
        let slot = match self.slot(key, None) {
            Ok(Some(slot)) => slot,
            Ok(None) => return report,
            Err(e) => {
                report.failed.push((key.to_string(), e));
                return report;
            }
        };
        #[cfg(test)]
        if let Some(hook) = self.before_lock.locked().clone() {
            hook(key);
        }
        let mut held = match slot.try_lock() {
            Ok(held) => held,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => return report,
        };
        if !self.is_current(key, &slot) {
            // Stopped and forgotten since it was found.
            return report;
        }
        if held.released {
            match self.retire(key, &mut held) {
                Ok(true) => report.stopped.push(key.clone()),
                Ok(false) => {}
                Err(e) => report.failed.push((key.to_string(), e)),
            }
            return report;
        }
        match held.daemon.ensure_running(&self.config) {
            Ok(Outcome::AlreadyRunning) => {}
            Ok(Outcome::Adopted) => report.adopted.push(key.clone()),
            Ok(Outcome::Started) => report.restarted.push(key.clone()),
            Err(e) => report.failed.push((key.to_string(), e)),
        }
        report
    }

    /// Supervise every `every` on a thread until the returned handle is
    /// dropped, starting now. Each pass sees to every daemon on a thread of
    /// its own and does not wait on any: a daemon still being seen to when
    /// the next pass is due is skipped by it (a tenant that keeps its
    /// daemon from getting ready delays only its own claim), and what it
    /// did is reported with a later pass. `on_pass` sees each pass's report
    /// (to log or count restarts): what finished within the period.
    pub fn spawn_watchdog(
        self: &Arc<Self>,
        every: Duration,
        on_pass: impl Fn(&SupervisionReport) + Send + 'static,
    ) -> Watchdog {
        let (tx, messages) = mpsc::channel::<Message>();
        let me = Arc::clone(self);
        let done = tx.clone();
        let thread = std::thread::Builder::new()
            .name("mps-watchdog".into())
            .spawn(move || me.watch(every, &done, &messages, on_pass))
            .expect("spawning the MPS watchdog thread");
        Watchdog {
            stop: Some(tx),
            thread: Some(thread),
        }
    }

    /// The watchdog's loop: a pass, its workers' results until all are in
    /// or the next pass is due, `on_pass`, the rest of the period.
    fn watch(
        self: Arc<Self>,
        every: Duration,
        done: &mpsc::Sender<Message>,
        messages: &mpsc::Receiver<Message>,
        on_pass: impl Fn(&SupervisionReport),
    ) {
        // Results of workers that outlived their pass.
        let mut late = SupervisionReport::default();
        for pass in 0u64.. {
            let mut report = std::mem::take(&mut late);
            let mut waiting = 0usize;
            for key in self.known_daemons(&mut report) {
                let (me, done, k) = (Arc::clone(&self), done.clone(), key.clone());
                let work = move || {
                    let _ = done.send(Message::Done(pass, me.supervise_one(&k)));
                };
                match worker_thread().spawn(work) {
                    Ok(_) => waiting += 1,
                    Err(e) => report
                        .failed
                        .push((key.to_string(), self.no_thread(&key, e))),
                }
            }
            let next = Instant::now() + every;
            let mut reported = false;
            loop {
                if waiting == 0 && !reported {
                    report.sort();
                    on_pass(&report);
                    reported = true;
                }
                match messages.recv_timeout(next.saturating_duration_since(Instant::now())) {
                    Ok(Message::Done(of, result)) => {
                        if of == pass {
                            waiting -= 1;
                        }
                        if reported { &mut late } else { &mut report }.merge(result);
                    }
                    Ok(Message::Stop) | Err(mpsc::RecvTimeoutError::Disconnected) => return,
                    Err(mpsc::RecvTimeoutError::Timeout) => break,
                }
            }
            if !reported {
                report.sort();
                on_pass(&report);
            }
        }
    }

    fn no_thread(&self, key: &DaemonKey, source: std::io::Error) -> MpsError {
        MpsError::Io {
            device: key.device.clone(),
            what: "starting a thread to supervise the daemon in",
            path: self.config.state_dir.join(key.claim.as_str()),
            source,
        }
    }

    /// The daemons recorded, for status and metrics.
    pub fn daemons(&self) -> Vec<MpsDaemon> {
        let mut report = SupervisionReport::default();
        self.known_daemons(&mut report)
            .into_iter()
            .filter_map(|key| {
                self.with_daemon(&key, None, |held| held.daemon.info())
                    .ok()?
            })
            .collect()
    }

    /// How many daemons are supervised, without waiting on any of them
    /// (a daemon's own lock is held while it starts or stops; the map's
    /// only for lookups). For the metrics.
    pub fn supervised(&self) -> usize {
        self.daemons.locked().len()
    }

    // -- internals -----------------------------------------------------------

    /// Run `f` on the daemon of `key` (see [`MpsSupervisor::slot`]) under
    /// its lock; `None` when there is none. A daemon stopped and forgotten
    /// while this waited for its lock is looked up again: `f` never sees a
    /// daemon the supervisor no longer holds.
    fn with_daemon<R>(
        &self,
        key: &DaemonKey,
        limits: Option<ClientLimits>,
        f: impl FnOnce(&mut Held) -> R,
    ) -> Result<Option<R>, MpsError> {
        loop {
            let Some(slot) = self.slot(key, limits)? else {
                return Ok(None);
            };
            let mut held = slot.locked();
            if self.is_current(key, &slot) {
                return Ok(Some(f(&mut held)));
            }
        }
    }

    /// Whether `slot` is still the daemon of `key` (not forgotten since it
    /// was found). Called with the slot's lock held.
    fn is_current(&self, key: &DaemonKey, slot: &Slot) -> bool {
        self.daemons
            .locked()
            .get(key)
            .is_some_and(|held| Arc::ptr_eq(held, slot))
    }

    /// The daemon of `key`: held, recorded, or (given `limits`) new.
    fn slot(
        &self,
        key: &DaemonKey,
        limits: Option<ClientLimits>,
    ) -> Result<Option<Slot>, MpsError> {
        if !is_device_uuid(&key.device) {
            return Err(MpsError::BadDevice(key.device.clone()));
        }
        let mut daemons = self.daemons.locked();
        if let Some(d) = daemons.get(key) {
            return Ok(Some(Arc::clone(d)));
        }
        let Some(daemon) = Daemon::load(&self.config.state_dir, key, limits)? else {
            return Ok(None);
        };
        let slot = Arc::new(Mutex::new(Held {
            daemon,
            released: false,
        }));
        daemons.insert(key.clone(), Arc::clone(&slot));
        Ok(Some(slot))
    }

    /// Daemons with a record under the state dir or an in-memory entry.
    /// Directories of the per-device daemons of earlier versions are retired
    /// on the way (see [`retire_shared_daemon`]).
    fn known_daemons(&self, report: &mut SupervisionReport) -> Vec<DaemonKey> {
        let mut keys: std::collections::BTreeSet<DaemonKey> =
            self.daemons.locked().keys().cloned().collect();
        let Ok(claims) = fs::read_dir(&self.config.state_dir) else {
            return keys.into_iter().collect();
        };
        for claim_dir in claims.flatten() {
            let Some(name) = claim_dir.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            if is_device_uuid(&name) {
                if let Err(e) = retire_shared_daemon(&claim_dir.path()) {
                    report.failed.push((name, e));
                }
                continue;
            }
            if ClaimUid::parse(&name).is_err() {
                continue;
            }
            let Ok(tags) = fs::read_dir(claim_dir.path()) else {
                continue;
            };
            for tag in tags.flatten() {
                let path = tag.path().join(RECORD);
                let record = fs::read(&path)
                    .ok()
                    .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
                    .and_then(|v| serde_json::from_value::<DaemonKey>(v["key"].clone()).ok());
                if let Some(key) = record {
                    keys.insert(key);
                } else if written_before_this_boot(&path) {
                    // Torn by a crash of an earlier boot: nothing it named
                    // runs, and no mount survived the reboot.
                    let _ = fs::remove_dir_all(tag.path());
                }
            }
        }
        keys.into_iter().collect()
    }
}

/// An earlier version ran one daemon per device, shared by every claim on
/// it (`<state>/<device uuid>/supervisor.json`). Such a daemon died with
/// the driver's container on upgrade in the documented deployment; one that
/// still runs (a host install) is stopped, since it serves claims of any
/// namespace through one pipe directory, and its directory is removed.
/// Claims prepared by that version keep their CDI specs; their containers
/// run outside MPS until their Pods are recreated.
fn retire_shared_daemon(dir: &Path) -> Result<(), MpsError> {
    let device = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let record = dir.join("supervisor.json");
    let daemon = fs::read(&record)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| serde_json::from_value::<ProcessId>(v["daemon"].clone()).ok());
    if let Some(id) = daemon {
        let io = |what| {
            let device = device.clone();
            move |source| MpsError::Io {
                device,
                what,
                path: PathBuf::from(format!("/proc/{}", id.pid)),
                source,
            }
        };
        if let Some(pidfd) = Pidfd::open(&id).map_err(io("taking hold of a shared daemon"))? {
            pidfd.kill().map_err(io("stopping a shared daemon"))?;
            pidfd.wait(Duration::from_secs(5));
        }
    }
    ignore_missing(fs::remove_dir_all(dir)).map_err(|source| MpsError::Io {
        device,
        what: "removing the directory of a shared daemon",
        path: dir.to_owned(),
        source,
    })
}

fn remove_if_empty(dir: &Path) {
    // Fails (and is meant to) while another daemon of the claim is there.
    let _ = fs::remove_dir(dir);
}

/// A supervision thread's name; the workers of a pass.
fn worker_thread() -> std::thread::Builder {
    std::thread::Builder::new().name("mps-supervise".into())
}

/// What the watchdog thread hears.
enum Message {
    /// A worker of pass `.0` finished.
    Done(u64, SupervisionReport),
    Stop,
}

/// Stops the watchdog thread when dropped. Workers still seeing to a
/// daemon finish on their own.
pub struct Watchdog {
    stop: Option<mpsc::Sender<Message>>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(Message::Stop);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests;
