//! The listener interface: the link that carries every listener address (/32 and /128), so that
//! the node itself answers on them. By default a `dummy` link `redirector0` that the agent creates;
//! on kernels without the dummy driver, an existing link (tests use a veth). IPv6 addresses are
//! added with `IFA_F_NODAD`, and duplicate address detection is off on the link before it comes
//! up, so they are usable at once. Idempotent: an existing link and addresses are adopted.
//!
//! Everything happens in the caches' network namespace (rtnetlink through a socket created
//! there).

use std::{
    collections::HashSet,
    net::IpAddr,
    os::fd::{FromRawFd as _, IntoRawFd as _},
};

use futures::TryStreamExt as _;
use netlink_packet_route::address::{AddressAttribute, AddressFlags, AddressHeaderFlags};
use netlink_sys::{Socket, TokioSocket, protocols::NETLINK_ROUTE};
use rtnetlink::{Handle, LinkDummy, LinkUnspec};
use tracing::info;

use crate::{
    config::{InterfaceKind, InterfaceSettings},
    netns::{NetnsError, NetnsWorker},
};

/// Why the listener interface could not be set up or removed.
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

    async fn addresses(&self, index: u32, name: &str) -> Result<HashSet<IpAddr>, InterfaceError> {
        let messages: Vec<_> = self
            .handle
            .address()
            .get()
            .set_link_index_filter(index)
            .execute()
            .try_collect()
            .await
            .map_err(netlink(name, "listing addresses"))?;
        Ok(messages
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

/// Makes sure the listener link exists, is up and carries every one of `addresses`. Returns the
/// addresses it added.
pub async fn ensure(
    settings: &InterfaceSettings,
    addresses: &[IpAddr],
    worker: &NetnsWorker,
) -> Result<Vec<IpAddr>, InterfaceError> {
    let name = settings.name.as_str();
    let connection = Connection::open(worker).await?;
    let index = match (connection.link_index(name).await?, settings.kind) {
        (Some(index), _) => index,
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
            connection
                .link_index(name)
                .await?
                .ok_or_else(|| InterfaceError::Missing {
                    name: name.to_owned(),
                })?
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

/// Removes `addresses` from the listener link, and the link itself when the agent created it
/// (kind `dummy`). A missing link is nothing to do.
pub async fn remove(
    settings: &InterfaceSettings,
    addresses: &[IpAddr],
    worker: &NetnsWorker,
) -> Result<(), InterfaceError> {
    let name = settings.name.as_str();
    let connection = Connection::open(worker).await?;
    let Some(index) = connection.link_index(name).await? else {
        return Ok(());
    };
    if settings.kind == InterfaceKind::Dummy {
        connection
            .handle
            .link()
            .del(index)
            .execute()
            .await
            .map_err(netlink(name, "deleting the listener link"))?;
        info!(link = name, "deleted the listener link");
        return Ok(());
    }
    let wanted: HashSet<IpAddr> = addresses.iter().copied().collect();
    let messages: Vec<_> = connection
        .handle
        .address()
        .get()
        .set_link_index_filter(index)
        .execute()
        .try_collect()
        .await
        .map_err(netlink(name, "listing addresses"))?;
    for message in messages {
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
    info!(link = name, "removed the listener addresses");
    Ok(())
}
