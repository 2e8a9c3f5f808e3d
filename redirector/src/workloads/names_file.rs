//! The agent's record of this node's pod names, for `redirector status` and `redirector top`,
//! which never ask the API server: `pod-names.json` beside the lock file (`/run/redirector`, a
//! hostPath in the DaemonSet, so the CLI reads it on the node and in the agent's pod alike).
//! The agent writes it whole (a temporary file renamed over it) when the names the API server
//! gave it change. A pod's UID is never reused, so a record left by a stopped agent never names
//! a pod wrongly; a pod started since is named by its UID.

use std::path::{Path, PathBuf};

use super::pods::{PodNames, PodRecord};

/// Its name, in the lock file's directory.
const FILE_NAME: &str = "pod-names.json";

/// Where the agent whose lock file is `lock_file` records the pod names.
#[must_use]
pub fn path(lock_file: &Path) -> PathBuf {
    lock_file.with_file_name(FILE_NAME)
}

/// Why the record cannot be written or read.
#[derive(Debug, thiserror::Error)]
pub enum NamesFileError {
    /// Writing it failed.
    #[error(
        "cannot write the pod names for `redirector status` and `top` to {path} (they name pods \
         by UID until it works)"
    )]
    Write {
        /// The record's path.
        path: PathBuf,
        /// What the file system said.
        #[source]
        source: std::io::Error,
    },
    /// Reading it failed.
    #[error("cannot read the pod names the agent recorded in {path}; pods are named by UID")]
    Read {
        /// The record's path.
        path: PathBuf,
        /// What the file system said.
        #[source]
        source: std::io::Error,
    },
    /// It is not a record this release reads.
    #[error(
        "{path} is not a record of pod names this release reads (another release's agent wrote \
         it?); pods are named by UID"
    )]
    Parse {
        /// The record's path.
        path: PathBuf,
        /// What the parser said.
        #[source]
        source: serde_json::Error,
    },
}

/// The file's contents.
#[derive(serde::Serialize, serde::Deserialize)]
struct Contents {
    pods: Vec<PodRecord>,
}

/// The agent's writer of the record.
#[derive(Debug)]
pub struct Writer {
    path: PathBuf,
    /// What it last wrote.
    written: Option<Vec<PodRecord>>,
}

impl Writer {
    /// A writer of the record at `path` ([`path`]); it writes nothing yet.
    #[must_use]
    pub const fn new(path: PathBuf) -> Self {
        Self {
            path,
            written: None,
        }
    }

    /// Records `pods`' names, unless no list of them completed yet or they are what it wrote
    /// last; true when it wrote.
    pub fn write(&mut self, pods: &PodNames) -> Result<bool, NamesFileError> {
        if !pods.listed() {
            return Ok(false);
        }
        let records = pods.records();
        if self.written.as_ref() == Some(&records) {
            return Ok(false);
        }
        let contents = Contents { pods: records };
        let error = |source| NamesFileError::Write {
            path: self.path.clone(),
            source,
        };
        let text = serde_json::to_vec(&contents).map_err(|source| error(source.into()))?;
        let temporary = self.path.with_extension("json.new");
        std::fs::write(&temporary, text).map_err(error)?;
        std::fs::rename(&temporary, &self.path).map_err(error)?;
        self.written = Some(contents.pods);
        Ok(true)
    }
}

/// The names recorded at `path`; `None` where there is no record (no agent followed the API
/// server here).
pub fn read(path: &Path) -> Result<Option<PodNames>, NamesFileError> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(NamesFileError::Read {
                path: path.to_owned(),
                source,
            });
        }
    };
    let contents: Contents =
        serde_json::from_slice(&bytes).map_err(|source| NamesFileError::Parse {
            path: path.to_owned(),
            source,
        })?;
    Ok(Some(PodNames::from_records(contents.pods)))
}

#[cfg(test)]
mod tests {
    use kube::runtime::watcher;

    use super::*;

    fn pod(uid: &str, name: &str, config_hash: Option<&str>) -> PodRecord {
        PodRecord {
            uid: uid.to_owned(),
            namespace: "default".to_owned(),
            name: name.to_owned(),
            config_hash: config_hash.map(ToOwned::to_owned),
        }
    }

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "redirector-names-file-{tag}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        dir
    }

    /// What the agent records is what the CLI reads back: pods by UID, a static pod by its
    /// configuration hash too; nothing before the first list, and no rewrite of the same names.
    #[test]
    fn the_cli_reads_the_names_the_agent_recorded() {
        let dir = scratch("round-trip");
        let path = path(&dir.join("agent.lock"));
        assert_eq!(path, dir.join("pod-names.json"));
        assert!(read(&path).expect("no record is no error").is_none());

        let pods = PodNames::new();
        let mut writer = Writer::new(path.clone());
        assert!(!writer.write(&pods).expect("nothing to write"));
        assert!(!path.exists(), "written before the pods were listed");

        pods.handle(watcher::Event::Init);
        pods.handle(watcher::Event::InitApply(pod("uid-1", "web-0", None)));
        pods.handle(watcher::Event::InitApply(pod(
            "uid-2",
            "etcd-node",
            Some("hash-2"),
        )));
        pods.handle(watcher::Event::InitDone);
        assert!(writer.write(&pods).expect("written"));
        assert!(
            !writer.write(&pods).expect("unchanged"),
            "rewritten unchanged"
        );

        let read = read(&path).expect("read").expect("a record");
        let name = |key: &str| read.name(key);
        assert_eq!(name("uid-1"), Some(("default".into(), "web-0".into())));
        assert_eq!(name("hash-2"), Some(("default".into(), "etcd-node".into())));
        assert_eq!(name("uid-3"), None);

        pods.handle(watcher::Event::Delete(pod("uid-1", "web-0", None)));
        assert!(writer.write(&pods).expect("written again"));
        let read = super::read(&path).expect("read").expect("a record");
        assert_eq!(read.name("uid-1"), None, "a deleted pod stays named");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A record this release cannot read is an error that says so, not a panic or silence.
    #[test]
    fn a_record_of_another_shape_is_an_error() {
        let dir = scratch("other-shape");
        let path = dir.join("pod-names.json");
        std::fs::write(&path, b"[1, 2]").expect("written");
        assert!(matches!(read(&path), Err(NamesFileError::Parse { .. })));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
