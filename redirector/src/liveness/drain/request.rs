//! A drain as asked over the agent's drain socket (one JSON line each way): the request, read
//! as either release writes it, and the reply.

use serde::{Deserialize, Serialize};

use super::Selection;

/// A drain asked of the agent over its drain socket (one JSON line), or done by the CLI itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "WireRequest", into = "WireRequest")]
pub struct DrainRequest {
    /// The caches to drain.
    pub selection: Selection,
    /// End a drain instead of beginning one.
    pub cancel: bool,
    /// Wait until the cache has read what it was handed ([`wait_quiet`](super::wait_quiet)).
    pub wait: bool,
    /// How long to wait, in ms.
    pub timeout_ms: u64,
    /// How long to give the last answers once nothing is unread, in ms.
    pub settle_ms: u64,
}

/// A [`DrainRequest`] on the drain socket. Releases before whole-cache drains send and read one
/// name as `listener` (and ignore fields they do not know): the first name goes there too, so
/// that such an agent drains at least that listener, and a request from such a CLI drains the
/// whole cache of the listener it names.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct WireRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    listener: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    listeners: Vec<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    all: bool,
    #[serde(default)]
    cancel: bool,
    #[serde(default)]
    wait: bool,
    #[serde(default = "default_timeout_ms")]
    timeout_ms: u64,
    #[serde(default = "default_settle_ms")]
    settle_ms: u64,
}

impl From<WireRequest> for DrainRequest {
    fn from(wire: WireRequest) -> Self {
        let mut listeners: Vec<String> = Vec::new();
        for name in wire.listener.into_iter().chain(wire.listeners) {
            if !listeners.contains(&name) {
                listeners.push(name);
            }
        }
        Self {
            selection: Selection {
                listeners,
                all: wire.all,
            },
            cancel: wire.cancel,
            wait: wire.wait,
            timeout_ms: wire.timeout_ms,
            settle_ms: wire.settle_ms,
        }
    }
}

impl From<DrainRequest> for WireRequest {
    fn from(request: DrainRequest) -> Self {
        Self {
            listener: request.selection.listeners.first().cloned(),
            listeners: request.selection.listeners,
            all: request.selection.all,
            cancel: request.cancel,
            wait: request.wait,
            timeout_ms: request.timeout_ms,
            settle_ms: request.settle_ms,
        }
    }
}

/// `DrainRequest::timeout_ms` unless given.
pub const DEFAULT_TIMEOUT_MS: u64 = 10_000;
/// `DrainRequest::settle_ms` unless given.
pub const DEFAULT_SETTLE_MS: u64 = 300;

const fn default_timeout_ms() -> u64 {
    DEFAULT_TIMEOUT_MS
}

const fn default_settle_ms() -> u64 {
    DEFAULT_SETTLE_MS
}

/// The agent's answer on its drain socket (one JSON line).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainReply {
    /// Whether the request was done.
    pub ok: bool,
    /// What happened, or what failed and what to do, for people.
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wire_request_is_read_by_either_release() {
        // A CLI from before whole-cache drains names one listener.
        let old: DrainRequest = serde_json::from_str(
            r#"{"listener":"cluster-ip","cancel":false,"wait":true,"timeout_ms":2500,"settle_ms":300}"#,
        )
        .unwrap();
        assert_eq!(
            old.selection,
            Selection {
                listeners: vec!["cluster-ip".to_owned()],
                all: false,
            }
        );
        assert!(old.wait);
        assert_eq!(old.timeout_ms, 2500);
        // This release's request carries every name, and the first alone as `listener`, which is
        // what an agent from before reads.
        let request = DrainRequest {
            selection: Selection {
                listeners: vec!["node".to_owned(), "cluster".to_owned()],
                all: false,
            },
            cancel: false,
            wait: true,
            timeout_ms: DEFAULT_TIMEOUT_MS,
            settle_ms: DEFAULT_SETTLE_MS,
        };
        let line = serde_json::to_string(&request).unwrap();
        let value: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(value["listener"], "node", "{line}");
        assert_eq!(value["listeners"], serde_json::json!(["node", "cluster"]));
        assert_eq!(
            serde_json::from_str::<DrainRequest>(&line).unwrap(),
            request
        );
        let all = DrainRequest {
            selection: Selection {
                listeners: Vec::new(),
                all: true,
            },
            ..request
        };
        let line = serde_json::to_string(&all).unwrap();
        assert!(!line.contains("listener"), "{line}");
        assert_eq!(serde_json::from_str::<DrainRequest>(&line).unwrap(), all);
    }
}
