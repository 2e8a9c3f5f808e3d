//! The listener interface: the link that carries every listener address (/32 and /128), so that
//! the node itself answers on them. By default a `dummy` link `redirector0` that the agent creates;
//! on kernels without the dummy driver, an existing link (tests use a veth). IPv6 addresses are
//! added with `IFA_F_NODAD`, and duplicate address detection is off on the link before it comes
//! up, so they are usable at once. Idempotent: an existing link and addresses are adopted.
//!
//! What the agent owns is recorded in a file next to its lock ([`Ownership`]): whether it created
//! the link, and which addresses it added to a link it adopted. Uninstall removes only that, so
//! a link that was there before (NodeLocal DNSCache's, say), and the addresses it had, stay.
//!
//! Everything happens in the caches' network namespace (rtnetlink through a socket created
//! there).

use std::{
    collections::HashSet,
    net::IpAddr,
    os::fd::{FromRawFd as _, IntoRawFd as _},
    path::{Path, PathBuf},
};

use futures::TryStreamExt as _;
use netlink_packet_route::address::{
    AddressAttribute, AddressFlags, AddressHeaderFlags, AddressMessage,
};
use netlink_sys::{Socket, TokioSocket, protocols::NETLINK_ROUTE};
use rtnetlink::{Handle, LinkDummy, LinkUnspec};
use tracing::{info, warn};

use crate::{
    config::{InterfaceKind, InterfaceSettings},
    sys::netns::{NetnsError, NetnsWorker},
};

/// Why the listener interface could not be set up or removed. `path` is the record of what the
/// agent owns of the link (`interface.json` beside the lock file).
#[derive(Debug, thiserror::Error)]
pub enum InterfaceError {
    /// The rtnetlink socket could not be opened.
    #[error("cannot open an rtnetlink socket in the caches' network namespace")]
    Socket(#[source] NetnsError),
    /// The configured existing link is not there.
    #[error(
        "interface.name: there is no link {name} (interface.kind is \"existing\"); create it, or \
         use kind \"dummy\" to let the agent create one"
    )]
    Missing {
        /// The link's name.
        name: String,
    },
    /// The kernel has no dummy driver.
    #[error(
        "creating the dummy link {name} failed: this kernel has no dummy driver (load it with \
         `modprobe dummy`), or set interface.kind = \"existing\" and interface.name to a link \
         that exists"
    )]
    NoDummyDriver {
        /// The link's name.
        name: String,
        /// What the kernel said.
        #[source]
        source: rtnetlink::Error,
    },
    /// Another rtnetlink request failed.
    #[error("{action} on {name} failed")]
    Netlink {
        /// What was being done.
        action: &'static str,
        /// The link's name.
        name: String,
        /// What the kernel said.
        #[source]
        source: rtnetlink::Error,
    },
    /// The ownership record could not be written or removed.
    #[error("cannot write the record of what the agent owns of the listener link, {path}")]
    Record {
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// Turning duplicate address detection off failed.
    #[error("cannot turn duplicate address detection off on {name}")]
    AcceptDad {
        /// The link's name.
        name: String,
        /// What the OS said.
        #[source]
        source: NetnsError,
    },
}

/// What the agent owns of the listener link, kept in `record` (JSON) from the moment it
/// changes anything: a crash after an address was added but before it was recorded leaves that
/// address unowned, so uninstall leaves it (never the other way round).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Ownership {
    /// The link's name.
    pub link: String,
    /// The link's index when the agent created it (`None`: the link was there before). A link
    /// of that name with another index is someone else's.
    pub created: Option<u32>,
    /// Addresses the agent added (to a link it created too, since this release: an address of a
    /// listener no longer configured is removed at the next start).
    pub added: Vec<IpAddr>,
}

impl Ownership {
    /// The record at `path` for the link `name`; none when there is no record, it is of another
    /// link, or it cannot be read (then nothing counts as owned).
    #[must_use]
    pub fn read(path: &Path, name: &str) -> Option<Self> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return None,
            Err(error) => {
                warn!(path = %path.display(), error = %error, "cannot read the listener link's ownership record; treating nothing on it as the agent's");
                return None;
            }
        };
        match serde_json::from_str::<Self>(&text) {
            Ok(record) => (record.link == name).then_some(record),
            Err(error) => {
                warn!(path = %path.display(), error = %error, "the listener link's ownership record is unreadable; treating nothing on it as the agent's");
                None
            }
        }
    }

    /// Writes the record to `path` (a temporary file renamed over it).
    fn write(&self, path: &Path) -> Result<(), InterfaceError> {
        let error = |source| InterfaceError::Record {
            path: path.to_owned(),
            source,
        };
        let text = serde_json::to_string(self).map_err(|source| error(source.into()))?;
        let temporary = path.with_extension("json.new");
        std::fs::write(&temporary, text).map_err(error)?;
        std::fs::rename(&temporary, path).map_err(error)
    }
}

/// Where the ownership record of the agent whose lock file is `lock_file` lives.
#[must_use]
pub fn record_path(lock_file: &Path) -> PathBuf {
    lock_file.with_file_name("interface.json")
}

/// An rtnetlink connection in the caches' namespace.
struct Connection {
    handle: Handle,
}

impl Connection {
    async fn open(worker: &NetnsWorker) -> Result<Self, InterfaceError> {
        let fd = worker
            .run("opening an rtnetlink socket", || {
                let mut socket = Socket::new(NETLINK_ROUTE)?;
                socket.bind_auto()?;
                Ok(socket.into_raw_fd())
            })
            .await
            .map_err(InterfaceError::Socket)?;
        // SAFETY: `fd` is the netlink socket just created, owned by nobody else.
        let socket = unsafe { TokioSocket::from_raw_fd(fd) };
        let (connection, handle, _) = rtnetlink::from_socket(socket);
        tokio::spawn(connection);
        Ok(Self { handle })
    }

    async fn link_index(&self, name: &str) -> Result<Option<u32>, InterfaceError> {
        let mut links = self
            .handle
            .link()
            .get()
            .match_name(name.to_owned())
            .execute();
        match links.try_next().await {
            Ok(link) => Ok(link.map(|link| link.header.index)),
            Err(rtnetlink::Error::NetlinkError(error)) if error.raw_code() == -libc::ENODEV => {
                Ok(None)
            }
            Err(source) => Err(netlink(name, "looking up the link")(source)),
        }
    }

    /// The address messages of link `index`.
    async fn address_messages(
        &self,
        index: u32,
        name: &str,
    ) -> Result<Vec<AddressMessage>, InterfaceError> {
        self.handle
            .address()
            .get()
            .set_link_index_filter(index)
            .execute()
            .try_collect()
            .await
            .map_err(netlink(name, "listing addresses"))
    }

    async fn addresses(&self, index: u32, name: &str) -> Result<HashSet<IpAddr>, InterfaceError> {
        Ok(self
            .address_messages(index, name)
            .await?
            .iter()
            .flat_map(|message| &message.attributes)
            .filter_map(|attribute| match attribute {
                AddressAttribute::Address(ip) => Some(*ip),
                _ => None,
            })
            .collect())
    }
}

/// Wraps what netlink said while doing `action` to the link `name`.
fn netlink(name: &str, action: &'static str) -> impl FnOnce(rtnetlink::Error) -> InterfaceError {
    let name = name.to_owned();
    move |source| InterfaceError::Netlink {
        action,
        name,
        source,
    }
}

/// Makes sure the listener link exists, is up and carries every one of `addresses`, recording in
/// `record` what the agent created or added. Returns the addresses it added.
pub async fn ensure(
    settings: &InterfaceSettings,
    addresses: &[IpAddr],
    worker: &NetnsWorker,
    record: &Path,
) -> Result<Vec<IpAddr>, InterfaceError> {
    let name = settings.name.as_str();
    let connection = Connection::open(worker).await?;
    let prior = Ownership::read(record, name);
    let (index, mut owned) = match (connection.link_index(name).await?, settings.kind) {
        (Some(index), _) => match prior {
            // Created by an earlier agent: still ours.
            Some(prior) if prior.created == Some(index) => (index, prior),
            prior => {
                if prior.is_none() && settings.kind == InterfaceKind::Dummy {
                    info!(
                        link = name,
                        "adopting a link that was there before; uninstall leaves it"
                    );
                }
                let owned = Ownership {
                    link: name.to_owned(),
                    created: None,
                    added: prior.map(|prior| prior.added).unwrap_or_default(),
                };
                (index, owned)
            }
        },
        (None, InterfaceKind::Existing) => {
            return Err(InterfaceError::Missing {
                name: name.to_owned(),
            });
        }
        (None, InterfaceKind::Dummy) => {
            connection
                .handle
                .link()
                .add(LinkDummy::new(name).build())
                .execute()
                .await
                .map_err(|source| InterfaceError::NoDummyDriver {
                    name: name.to_owned(),
                    source,
                })?;
            info!(link = name, "created the listener link");
            let index =
                connection
                    .link_index(name)
                    .await?
                    .ok_or_else(|| InterfaceError::Missing {
                        name: name.to_owned(),
                    })?;
            let owned = Ownership {
                link: name.to_owned(),
                created: Some(index),
                added: Vec::new(),
            };
            owned.write(record)?;
            (index, owned)
        }
    };

    // Before the link is up: no duplicate address detection on it at all.
    if addresses.iter().any(IpAddr::is_ipv6) {
        let sysctl = format!("/proc/sys/net/ipv6/conf/{name}/accept_dad");
        worker
            .run("turning accept_dad off", move || {
                std::fs::write(sysctl, "0")
            })
            .await
            .map_err(|source| InterfaceError::AcceptDad {
                name: name.to_owned(),
                source,
            })?;
    }

    let present = connection.addresses(index, name).await?;
    let mut added = Vec::new();
    for address in addresses
        .iter()
        .copied()
        .filter(|address| !present.contains(address))
    {
        let prefix = if address.is_ipv4() { 32 } else { 128 };
        let mut request = connection.handle.address().add(index, address, prefix);
        if address.is_ipv6() {
            // Usable at once instead of after duplicate address detection (~1 s and more).
            let message = request.message_mut();
            message.header.flags |= AddressHeaderFlags::Nodad;
            message
                .attributes
                .push(AddressAttribute::Flags(AddressFlags::Nodad));
        }
        request
            .execute()
            .await
            .map_err(netlink(name, "adding a listener address"))?;
        added.push(address);
        if !owned.added.contains(&address) {
            owned.added.push(address);
            owned.write(record)?;
        }
    }
    if owned.created.is_none() && owned.added.is_empty() {
        // Nothing here is ours; a record says so (and replaces one of another link).
        owned.write(record)?;
    }
    connection
        .handle
        .link()
        .set(LinkUnspec::new_with_index(index).up().build())
        .execute()
        .await
        .map_err(netlink(name, "setting the link up"))?;
    if !added.is_empty() {
        info!(link = name, addresses = ?added, "added listener addresses");
    }
    Ok(added)
}

/// Removes from the listener link the addresses the agent added (as `record` says) for
/// listeners no longer among `addresses`, as uninstall would take them; an address someone else
/// put there stays. For after the attach: until then the running set may steer DNS there.
/// Returns the addresses removed.
pub async fn remove_unconfigured(
    settings: &InterfaceSettings,
    addresses: &[IpAddr],
    worker: &NetnsWorker,
    record: &Path,
) -> Result<Vec<IpAddr>, InterfaceError> {
    let name = settings.name.as_str();
    let Some(mut owned) = Ownership::read(record, name) else {
        return Ok(Vec::new());
    };
    let stale: Vec<IpAddr> = owned
        .added
        .iter()
        .copied()
        .filter(|address| !addresses.contains(address))
        .collect();
    if stale.is_empty() {
        return Ok(stale);
    }
    let connection = Connection::open(worker).await?;
    if let Some(index) = connection.link_index(name).await? {
        remove_addresses(&connection, index, name, &stale).await?;
    }
    owned.added.retain(|address| addresses.contains(address));
    owned.write(record)?;
    info!(link = name, addresses = ?stale, "removed the addresses of listeners no longer configured");
    Ok(stale)
}

/// Removes what `record` says the agent owns of the listener link: the link itself when the agent
/// created it, else the addresses it added; then the record. A link that was there before, and
/// the addresses it had, stay. Returns whether anything was removed.
pub async fn remove(
    settings: &InterfaceSettings,
    worker: &NetnsWorker,
    record: &Path,
) -> Result<bool, InterfaceError> {
    let name = settings.name.as_str();
    let owned = Ownership::read(record, name);
    let connection = Connection::open(worker).await?;
    let removed = match (connection.link_index(name).await?, owned) {
        (None, _) => false,
        (Some(index), Some(owned)) if owned.created == Some(index) => {
            connection
                .handle
                .link()
                .del(index)
                .execute()
                .await
                .map_err(netlink(name, "deleting the listener link"))?;
            info!(link = name, "deleted the listener link");
            true
        }
        (Some(index), Some(owned)) => {
            remove_addresses(&connection, index, name, &owned.added).await?;
            info!(link = name, addresses = ?owned.added, "removed the listener addresses the agent added; the link stays");
            !owned.added.is_empty()
        }
        (Some(_), None) => {
            warn!(
                link = name,
                "no record that the agent created or changed this link: left as it is (remove the listener addresses yourself if the agent added them)"
            );
            false
        }
    };
    match std::fs::remove_file(record) {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(InterfaceError::Record {
                path: record.to_owned(),
                source,
            });
        }
    }
    Ok(removed)
}

/// Removes every one of `addresses` that link `index` carries.
async fn remove_addresses(
    connection: &Connection,
    index: u32,
    name: &str,
    addresses: &[IpAddr],
) -> Result<(), InterfaceError> {
    let wanted: HashSet<IpAddr> = addresses.iter().copied().collect();
    for message in connection.address_messages(index, name).await? {
        let ours = message.attributes.iter().any(
            |attribute| matches!(attribute, AddressAttribute::Address(ip) if wanted.contains(ip)),
        );
        if ours {
            connection
                .handle
                .address()
                .del(message)
                .execute()
                .await
                .map_err(netlink(name, "removing a listener address"))?;
        }
    }
    Ok(())
}
