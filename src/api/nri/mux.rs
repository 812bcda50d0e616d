//! NRI's connection multiplexer, hand-written because no crate speaks it: NRI carries two ttrpc
//! connections over the one socket between a plugin and its runtime — the plugin's `Plugin`
//! service on connection 1 and the runtime's `Runtime` service on connection 2. Each write is
//! one frame: a big-endian 4-byte connection id, a big-endian 4-byte length, and that many
//! bytes of the connection's stream of ttrpc messages. Either side uses it (lodgerd's plugin,
//! the tests' fake runtime). Touches only the socket it is given.

use std::collections::HashMap;
use std::io;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream, ReadHalf, WriteHalf};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::Mutex;
use tokio::task::JoinSet;

/// The connection the plugin serves its `Plugin` service on.
pub const PLUGIN_SERVICE_CONN: u32 = 1;
/// The connection the runtime serves its `Runtime` service on.
pub const RUNTIME_SERVICE_CONN: u32 = 2;

/// A ttrpc message header: body length (4), stream id (4), type (1), flags (1).
const TTRPC_HEADER: usize = 10;
/// ttrpc's largest message body.
const TTRPC_MAX: usize = 4 << 20;
/// The largest frame sent. The Go side reads each connection through a 4096-byte buffer and
/// fails a frame larger than the buffer it reads into, so a longer message goes as Go's own
/// ttrpc sends it: a first 4096-byte frame, then the rest in one.
const FRAME_MAX: usize = 4096;
/// Buffer between a connection's ttrpc end and the socket.
const PIPE: usize = 64 * 1024;

/// One socket split into connections.
pub struct Mux {
    conns: HashMap<u32, DuplexStream>,
    tasks: JoinSet<io::Result<()>>,
}

impl Mux {
    /// Splits `trunk` into the connections `ids`. Frames for any other id are dropped, as NRI's
    /// own multiplexer drops them.
    pub fn new(trunk: UnixStream, ids: &[u32]) -> Self {
        let (rd, wr) = trunk.into_split();
        let wr = Arc::new(Mutex::new(wr));
        let mut tasks = JoinSet::new();
        let mut conns = HashMap::new();
        let mut inbound = HashMap::new();
        for &id in ids {
            let (ours, theirs) = tokio::io::duplex(PIPE);
            let (from_ttrpc, to_ttrpc) = tokio::io::split(ours);
            inbound.insert(id, to_ttrpc);
            tasks.spawn(send(id, from_ttrpc, Arc::clone(&wr)));
            conns.insert(id, theirs);
        }
        tasks.spawn(receive(rd, inbound));
        Self { conns, tasks }
    }

    /// Connection `id`'s stream, for a ttrpc client or server; `None` if not asked for or
    /// already taken.
    pub fn take(&mut self, id: u32) -> Option<DuplexStream> {
        self.conns.remove(&id)
    }

    /// Waits until the socket closes or fails (or one connection's ttrpc end is dropped), then
    /// ends every connection. Returns why.
    pub async fn closed(&mut self) -> io::Error {
        let why = match self.tasks.join_next().await {
            Some(Ok(Ok(()))) | None => io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the other side closed the connection",
            ),
            Some(Ok(Err(e))) => e,
            Some(Err(e)) => io::Error::other(e),
        };
        self.tasks.abort_all();
        why
    }
}

/// Reads frames from the socket and hands each to its connection.
async fn receive(
    mut rd: OwnedReadHalf,
    mut conns: HashMap<u32, WriteHalf<DuplexStream>>,
) -> io::Result<()> {
    let mut header = [0u8; 8];
    let mut body = Vec::new();
    loop {
        match rd.read_exact(&mut header).await {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let (id, len) = split_header(&header);
        if len > TTRPC_HEADER + TTRPC_MAX {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "a frame of {len} bytes for connection {id}: longer than any ttrpc message"
                ),
            ));
        }
        body.resize(len, 0);
        rd.read_exact(&mut body).await?;
        if let Some(conn) = conns.get_mut(&id) {
            conn.write_all(&body).await?;
        }
    }
}

/// Reads whole ttrpc messages from connection `id`'s ttrpc end and writes them as frames.
async fn send(
    id: u32,
    mut from: ReadHalf<DuplexStream>,
    wr: Arc<Mutex<OwnedWriteHalf>>,
) -> io::Result<()> {
    let mut msg = Vec::new();
    let mut frame = Vec::with_capacity(8 + FRAME_MAX);
    loop {
        msg.resize(TTRPC_HEADER, 0);
        match from.read_exact(&mut msg).await {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let len = u32::from_be_bytes([msg[0], msg[1], msg[2], msg[3]]) as usize;
        if len > TTRPC_MAX {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("a ttrpc message of {len} bytes: longer than ttrpc allows"),
            ));
        }
        msg.resize(TTRPC_HEADER + len, 0);
        from.read_exact(&mut msg[TTRPC_HEADER..]).await?;
        let mut wr = wr.lock().await;
        for chunk in msg.chunks(FRAME_MAX).take(1).chain(msg.get(FRAME_MAX..)) {
            if chunk.is_empty() {
                continue;
            }
            frame.clear();
            frame.extend_from_slice(&id.to_be_bytes());
            frame.extend_from_slice(&u32::try_from(chunk.len()).unwrap_or(u32::MAX).to_be_bytes());
            frame.extend_from_slice(chunk);
            wr.write_all(&frame).await?;
        }
    }
}

fn split_header(h: &[u8; 8]) -> (u32, usize) {
    let id = u32::from_be_bytes([h[0], h[1], h[2], h[3]]);
    let len = u32::from_be_bytes([h[4], h[5], h[6], h[7]]) as usize;
    (id, len)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A ttrpc-shaped message: header with `len`, then `len` bytes of `fill`.
    fn message(len: usize, fill: u8) -> Vec<u8> {
        let mut m = (len as u32).to_be_bytes().to_vec();
        m.extend_from_slice(&[0, 0, 0, 1, 1, 0]);
        m.extend(std::iter::repeat(fill).take(len));
        m
    }

    async fn frames(raw: &mut UnixStream, want_bytes: usize) -> Vec<(u32, usize)> {
        let mut got = Vec::new();
        let mut total = 0;
        while total < want_bytes {
            let mut h = [0u8; 8];
            raw.read_exact(&mut h).await.unwrap();
            let (id, len) = split_header(&h);
            let mut body = vec![0; len];
            raw.read_exact(&mut body).await.unwrap();
            got.push((id, len));
            total += len;
        }
        got
    }

    #[tokio::test]
    async fn messages_go_out_in_frames_the_go_side_can_read_and_come_back_whole() {
        let (a, mut raw) = UnixStream::pair().unwrap();
        let mut mux = Mux::new(a, &[PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN]);
        let mut plugin = mux.take(PLUGIN_SERVICE_CONN).unwrap();
        let mut runtime = mux.take(RUNTIME_SERVICE_CONN).unwrap();
        assert!(mux.take(RUNTIME_SERVICE_CONN).is_none());

        // Out: a small message is one frame; a long one is 4096 bytes, then the rest.
        plugin.write_all(&message(100, 7)).await.unwrap();
        runtime.write_all(&message(10_000, 9)).await.unwrap();
        let mut got = frames(&mut raw, 110 + 10_010).await;
        got.sort();
        assert_eq!(got, [(1, 110), (2, 4096), (2, 10_010 - 4096)]);

        // In: frames are reassembled per connection, whatever their sizes; other ids dropped.
        let m = message(5000, 3);
        for (id, part) in [
            (2u32, &m[..3]),
            (7, &m[..5]),
            (2, &m[3..4000]),
            (2, &m[4000..]),
        ] {
            let mut f = id.to_be_bytes().to_vec();
            f.extend_from_slice(&(part.len() as u32).to_be_bytes());
            f.extend_from_slice(part);
            raw.write_all(&f).await.unwrap();
        }
        let mut back = vec![0; m.len()];
        runtime.read_exact(&mut back).await.unwrap();
        assert_eq!(back, m);

        // A frame longer than any ttrpc message closes everything, and says why.
        let mut f = 1u32.to_be_bytes().to_vec();
        f.extend_from_slice(&u32::MAX.to_be_bytes());
        raw.write_all(&f).await.unwrap();
        let why = mux.closed().await;
        assert!(
            why.to_string().contains("longer than any ttrpc message"),
            "{why}"
        );
        let mut rest = Vec::new();
        assert_eq!(plugin.read_to_end(&mut rest).await.unwrap(), 0);
    }

    #[tokio::test]
    async fn the_other_side_closing_is_seen() {
        let (a, raw) = UnixStream::pair().unwrap();
        let mut mux = Mux::new(a, &[PLUGIN_SERVICE_CONN]);
        drop(raw);
        assert_eq!(mux.closed().await.kind(), io::ErrorKind::UnexpectedEof);
    }
}
