//! DNS over TCP framing (RFC 1035 section 4.2.2, RFC 7766): each message preceded by its length
//! as two bytes, big endian.
//!
//! Written on `readable`/`try_read` and `writable`/`try_write`, which tokio's `net` feature
//! provides, rather than on `AsyncReadExt`, which would need its `io-util` feature (and a rebuild
//! of everything that depends on tokio) for two small loops.

use std::io;

use tokio::net::TcpStream;

/// Reads one message. `Ok(None)`: the peer closed the connection between messages.
pub(crate) async fn read_frame(stream: &TcpStream) -> io::Result<Option<Vec<u8>>> {
    let mut length = [0_u8; 2];
    match fill(stream, &mut length).await? {
        0 => return Ok(None),
        2 => {}
        _ => return Err(io::ErrorKind::UnexpectedEof.into()),
    }
    let length = usize::from(u16::from_be_bytes(length));
    if length == 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "a DNS message of length 0",
        ));
    }
    let mut message = vec![0; length];
    if fill(stream, &mut message).await? < length {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(Some(message))
}

/// Writes one message with its length.
pub(crate) async fn write_frame(stream: &TcpStream, message: &[u8]) -> io::Result<()> {
    let length = u16::try_from(message.len()).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "a DNS message longer than 65535 bytes",
        )
    })?;
    let mut frame = Vec::with_capacity(message.len() + 2);
    frame.extend_from_slice(&length.to_be_bytes());
    frame.extend_from_slice(message);
    let mut written = 0;
    while written < frame.len() {
        stream.writable().await?;
        match stream.try_write(&frame[written..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(count) => written += count,
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

/// Reads until `buffer` is full or the peer closes; returns the bytes read.
async fn fill(stream: &TcpStream, buffer: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buffer.len() {
        stream.readable().await?;
        match stream.try_read(&mut buffer[filled..]) {
            Ok(0) => break,
            Ok(count) => filled += count,
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
            Err(error) => return Err(error),
        }
    }
    Ok(filled)
}
