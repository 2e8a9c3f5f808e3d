//! systemd's readiness protocol (`Type=notify`): one datagram to `$NOTIFY_SOCKET`. A few lines
//! instead of a crate: the protocol is a string sent to a unix socket (`sd_notify(3)`).

use std::os::unix::net::UnixDatagram;

/// Sends `state` (e.g. `READY=1`) to the service manager. Returns `Ok(false)` when not run by
/// one (`NOTIFY_SOCKET` unset).
pub fn notify(state: &str) -> std::io::Result<bool> {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return Ok(false);
    };
    let socket = UnixDatagram::unbound()?;
    let bytes = path.as_encoded_bytes();
    if let Some(name) = bytes.strip_prefix(b"@") {
        // An abstract socket: its name follows a NUL byte.
        use std::os::linux::net::SocketAddrExt as _;
        let address = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
        socket.send_to_addr(state.as_bytes(), &address)?;
    } else {
        socket.send_to(state.as_bytes(), &path)?;
    }
    Ok(true)
}
