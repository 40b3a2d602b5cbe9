//! The local cluster's state as `conformance/cluster.sh` records it, read
//! one way: `cluster.env` (the cluster's settings), `node/node.env` (the
//! simulated node's), the pid files, and the `export K='v'` lines
//! `cluster.sh env` prints.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A cluster's state directory (`TESSERA_CLUSTER_DIR`).
#[derive(Clone, Debug)]
pub struct ClusterState {
    dir: PathBuf,
}

impl ClusterState {
    pub fn new(state_dir: &Path) -> Self {
        ClusterState {
            dir: state_dir.to_owned(),
        }
    }

    /// What `cluster.sh start` recorded (`cluster.env`); empty when nothing is.
    pub fn cluster_env(&self) -> BTreeMap<String, String> {
        read_env_file(&self.dir.join("cluster.env"))
    }

    /// The directory of the simulated node of `cluster.sh node-start`.
    pub fn node_dir(&self) -> PathBuf {
        self.dir.join("node")
    }

    /// What `node-start` recorded (`node/node.env`); empty before the first.
    pub fn node_env(&self) -> BTreeMap<String, String> {
        read_env_file(&self.node_dir().join("node.env"))
    }

    /// The driver name the simulated node runs under (node-start's default
    /// when none is recorded).
    pub fn node_driver(&self) -> String {
        self.node_env()
            .remove("NODE_DRIVER")
            .unwrap_or_else(|| "gpu.tessera.dev".to_owned())
    }

    /// The pid recorded for `name` (`pids/<name>.pid`: the pid and its
    /// start time); it may have exited since.
    pub fn recorded_pid(&self, name: &str) -> Option<i32> {
        std::fs::read_to_string(self.dir.join("pids").join(format!("{name}.pid")))
            .ok()?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    }
}

fn read_env_file(path: &Path) -> BTreeMap<String, String> {
    std::fs::read_to_string(path)
        .map(|text| parse_env_file(&text))
        .unwrap_or_default()
}

/// The `KEY='value'` lines `cluster.sh` writes.
pub fn parse_env_file(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().trim_matches('\'').to_owned()))
        .collect()
}

/// The variables of `cluster.sh env` (`export K='v'` lines; the shell
/// suffixes of the `PATH`/`LD_LIBRARY_PATH` lines are dropped).
pub fn parse_exports(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("export "))
        .filter_map(|l| {
            let (k, rest) = l.split_once('=')?;
            let v = rest.strip_prefix('\'')?.split('\'').next()?;
            Some((k.to_owned(), v.to_owned()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_file_values_are_unquoted() {
        let m = parse_env_file("NODE_NAME='n1'\nKUBELET_ENABLED='0'\nAPISERVER_PORT=123\n");
        assert_eq!(m["NODE_NAME"], "n1");
        assert_eq!(m["KUBELET_ENABLED"], "0");
        assert_eq!(m["APISERVER_PORT"], "123");
    }

    #[test]
    fn exports_keep_the_quoted_value_only() {
        let m = parse_exports(
            "export KUBECONFIG='/s/kubeconfig'\nexport PATH='/s/bin':\"$PATH\"\n# note\nexport X=unquoted\n",
        );
        assert_eq!(m["KUBECONFIG"], "/s/kubeconfig");
        assert_eq!(m["PATH"], "/s/bin");
        assert!(!m.contains_key("X"));
    }

    #[test]
    fn the_state_directory_is_read_as_recorded() {
        let dir = std::env::temp_dir().join(format!("kit-cluster-{}", std::process::id()));
        let state = ClusterState::new(&dir);
        assert!(state.cluster_env().is_empty());
        assert_eq!(state.node_driver(), "gpu.tessera.dev");
        std::fs::create_dir_all(dir.join("node")).unwrap();
        std::fs::create_dir_all(dir.join("pids")).unwrap();
        std::fs::write(dir.join("cluster.env"), "CONTAINER_RUNTIME='containerd'\n").unwrap();
        std::fs::write(dir.join("node/node.env"), "NODE_DRIVER='x.tessera.dev'\n").unwrap();
        std::fs::write(dir.join("pids/tessera-node.pid"), "4242 123456\n").unwrap();
        assert_eq!(state.cluster_env()["CONTAINER_RUNTIME"], "containerd");
        assert_eq!(state.node_driver(), "x.tessera.dev");
        assert_eq!(state.recorded_pid("tessera-node"), Some(4242));
        assert_eq!(state.recorded_pid("kubelet"), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
