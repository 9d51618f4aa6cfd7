//! The `:authority` stock gRPC clients send on a Unix socket, made one the HTTP/2 server takes.
//!
//! grpc-python (since 1.57), grpc-java and grpc-go's older releases send the socket's path as
//! a request's `:authority` (`%2Frun%2Fsbx%2Fsbxd.sock`, `/run/sbx/sbxd.sock`). The HTTP/2
//! server under tonic (h2) refuses a request whose authority is not a URI authority: it resets
//! the stream with PROTOCOL_ERROR before any of sbxd's code sees it, and the client reports
//! `INTERNAL: Stream removed (RST_STREAM … error code 1)`. On a Unix socket the authority names
//! nothing (there is one server behind the socket), so this reader, between the socket and
//! the server, replaces an authority that is not one with `localhost`, which is what grpc-go
//! and tonic's own client send there.
//!
//! It reads the client's side of the connection frame by frame. Every frame passes as it came
//! but the header blocks (HEADERS and its CONTINUATIONs): those are decoded with the client's
//! HPACK table (`loona-hpack`) and written again as literals that never enter the server's
//! table, so the server's table stays empty and nothing depends on the two tables agreeing.
//! A connection that does not open with the HTTP/2 preface passes untouched. A header block
//! past [`MAX_HEADER_BLOCK`], a block cut by another frame, or one that does not decode ends
//! the connection (the server would end it for each of those too), and so does a block that
//! decodes to a header list past [`MAX_HEADER_LIST`].

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, ReadBuf};

/// The client connection preface (RFC 9113 §3.4).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER: usize = 9;
const HEADERS: u8 = 0x1;
const PUSH_PROMISE: u8 = 0x5;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The largest frame every HTTP/2 peer takes (SETTINGS_MAX_FRAME_SIZE's least value).
const MAX_FRAME: usize = 16_384;
/// The most a request's header block may hold here (the server's own list limit is lower).
pub const MAX_HEADER_BLOCK: usize = 1 << 20;
/// The most a request's header list may decode to here (a gRPC request's is well under
/// 8 KiB).
pub const MAX_HEADER_LIST: usize = 1 << 20;
/// The HPACK table size the server allows its clients (h2 advertises none: the default).
const TABLE_SIZE: usize = 4_096;
/// What replaces an authority that is not one.
const LOCALHOST: &[u8] = b"localhost";

/// Where the reader is in the client's byte stream.
enum State {
    /// Reading the preface; what came so far matches it.
    Preface,
    /// Not HTTP/2 with a preface: every byte passes.
    Passthrough,
    /// At a frame's header.
    Frame,
    /// Inside a frame that passes: this many payload bytes still to pass.
    Passing(usize),
    /// A header block under way (its HEADERS read, CONTINUATIONs to come).
    Block(Block),
}

struct Block {
    stream: u32,
    /// END_STREAM of the HEADERS frame.
    end_stream: bool,
    /// The HEADERS frame's priority fields, kept as they came.
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
}

/// A connection's reading side with bad authorities replaced; writes pass as they are.
pub struct AuthorityFix<IO> {
    io: IO,
    state: State,
    /// Bytes read from the socket, not yet looked at.
    input: Vec<u8>,
    /// Bytes ready for the server.
    output: Vec<u8>,
    sent: usize,
    eof: bool,
    decoder: loona_hpack::Decoder<'static>,
}

impl<IO> AuthorityFix<IO> {
    pub fn new(io: IO) -> Self {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(TABLE_SIZE);
        AuthorityFix {
            io,
            state: State::Preface,
            input: Vec::new(),
            output: Vec::new(),
            sent: 0,
            eof: false,
            decoder,
        }
    }

    /// Moves what can be moved from `input` to `output`.
    fn process(&mut self) -> io::Result<()> {
        loop {
            match &mut self.state {
                State::Preface => {
                    let n = self.input.len().min(PREFACE.len());
                    if self.input[..n] != PREFACE[..n] {
                        self.state = State::Passthrough;
                        continue;
                    }
                    if n < PREFACE.len() {
                        return Ok(());
                    }
                    self.output.extend(self.input.drain(..PREFACE.len()));
                    self.state = State::Frame;
                }
                State::Passthrough => {
                    self.output.append(&mut self.input);
                    return Ok(());
                }
                State::Passing(left) => {
                    let n = (*left).min(self.input.len());
                    self.output.extend(self.input.drain(..n));
                    *left -= n;
                    if *left > 0 {
                        return Ok(());
                    }
                    self.state = State::Frame;
                }
                State::Frame | State::Block(_) => {
                    if self.input.len() < FRAME_HEADER {
                        return Ok(());
                    }
                    let head = &self.input[..FRAME_HEADER];
                    let len = usize::from(head[0]) << 16
                        | usize::from(head[1]) << 8
                        | usize::from(head[2]);
                    let kind = head[3];
                    let flags = head[4];
                    let stream =
                        u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
                    let in_block = matches!(self.state, State::Block(_));
                    if !in_block && kind != HEADERS && kind != PUSH_PROMISE {
                        // A frame that carries no header block passes as it comes.
                        self.output.extend(self.input.drain(..FRAME_HEADER));
                        self.state = State::Passing(len);
                        continue;
                    }
                    if len > MAX_HEADER_BLOCK {
                        return Err(refused("a header frame larger than the gateway takes"));
                    }
                    if self.input.len() < FRAME_HEADER + len {
                        return Ok(());
                    }
                    let payload: Vec<u8> = self
                        .input
                        .drain(..FRAME_HEADER + len)
                        .skip(FRAME_HEADER)
                        .collect();
                    match std::mem::replace(&mut self.state, State::Frame) {
                        State::Block(mut block) => {
                            if kind != CONTINUATION || stream != block.stream {
                                return Err(refused("a header block cut by another frame"));
                            }
                            block.fragment.extend_from_slice(&payload);
                            self.take(block, flags)?;
                        }
                        _ if kind == PUSH_PROMISE => {
                            return Err(refused("a client may not send PUSH_PROMISE"));
                        }
                        _ => {
                            let block = open_block(stream, flags, &payload)?;
                            self.take(block, flags)?;
                        }
                    }
                }
            }
        }
    }

    /// A header block's frame read: the block is written out once it ends.
    fn take(&mut self, block: Block, flags: u8) -> io::Result<()> {
        if block.fragment.len() > MAX_HEADER_BLOCK {
            return Err(refused("a header block larger than the gateway takes"));
        }
        if flags & END_HEADERS == 0 {
            self.state = State::Block(block);
            return Ok(());
        }
        // Decoded, a block can be far larger than it came (each one-byte index may name a
        // 4 KiB entry of the table): what it decodes to is bounded too, as RFC 9113 counts a
        // header list (each field's name and value, and 32).
        let mut fields = Vec::new();
        let mut list_size = 0usize;
        self.decoder
            .decode_with_cb(&block.fragment, |name, value| {
                list_size = list_size.saturating_add(name.len() + value.len() + 32);
                if list_size <= MAX_HEADER_LIST {
                    fields.push((name.into_owned(), value.into_owned()));
                }
            })
            .map_err(|e| refused(&format!("a header block that does not decode: {e}")))?;
        if list_size > MAX_HEADER_LIST {
            return Err(refused("a header list larger than the gateway takes"));
        }
        let mut encoded = Vec::with_capacity(block.fragment.len() + 64);
        for (name, value) in &fields {
            let value: &[u8] = if name == b":authority" && !is_authority(value) {
                tracing::debug!(
                    authority = %String::from_utf8_lossy(value),
                    "a Unix-socket client sent an authority that is not one; it is taken as localhost"
                );
                LOCALHOST
            } else {
                value
            };
            literal(name, value, &mut encoded);
        }
        write_block(&block, &encoded, &mut self.output);
        Ok(())
    }
}

/// The block a HEADERS frame opens: its fragment without padding, its priority kept.
fn open_block(stream: u32, flags: u8, payload: &[u8]) -> io::Result<Block> {
    let mut body = payload;
    let mut pad = 0;
    if flags & PADDED != 0 {
        let Some((&n, rest)) = body.split_first() else {
            return Err(refused("a padded HEADERS frame without its pad length"));
        };
        pad = usize::from(n);
        body = rest;
    }
    let mut priority = None;
    if flags & PRIORITY != 0 {
        if body.len() < 5 {
            return Err(refused("a HEADERS frame too short for its priority"));
        }
        let mut fields = [0; 5];
        fields.copy_from_slice(&body[..5]);
        priority = Some(fields);
        body = &body[5..];
    }
    if pad > body.len() {
        return Err(refused("a HEADERS frame with more padding than payload"));
    }
    Ok(Block {
        stream,
        end_stream: flags & END_STREAM != 0,
        priority,
        fragment: body[..body.len() - pad].to_vec(),
    })
}

/// A header field as a literal that is not indexed, its name and value as plain strings
/// (RFC 7541 §6.2.2).
fn literal(name: &[u8], value: &[u8], out: &mut Vec<u8>) {
    out.push(0);
    for s in [name, value] {
        // Writing into a Vec cannot fail.
        let _ = loona_hpack::encoder::encode_integer_into(s.len(), 7, 0, out);
        out.extend_from_slice(s);
    }
}

/// A header block as a HEADERS frame and as many CONTINUATIONs as its size needs.
fn write_block(block: &Block, encoded: &[u8], out: &mut Vec<u8>) {
    let first_room = MAX_FRAME - if block.priority.is_some() { 5 } else { 0 };
    let first = &encoded[..encoded.len().min(first_room)];
    let mut rest = &encoded[first.len()..];
    let mut flags = 0;
    if block.end_stream {
        flags |= END_STREAM;
    }
    if rest.is_empty() {
        flags |= END_HEADERS;
    }
    let mut payload = Vec::with_capacity(first.len() + 5);
    if let Some(priority) = block.priority {
        flags |= PRIORITY;
        payload.extend_from_slice(&priority);
    }
    payload.extend_from_slice(first);
    frame(HEADERS, flags, block.stream, &payload, out);
    while !rest.is_empty() {
        let (chunk, tail) = rest.split_at(rest.len().min(MAX_FRAME));
        rest = tail;
        let flags = if rest.is_empty() { END_HEADERS } else { 0 };
        frame(CONTINUATION, flags, block.stream, chunk, out);
    }
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8], out: &mut Vec<u8>) {
    let len = payload.len() as u32;
    out.extend_from_slice(&len.to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}

/// Whether the server takes `value` as a request's authority.
fn is_authority(value: &[u8]) -> bool {
    hyper::http::uri::Authority::try_from(value).is_ok()
}

fn refused(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("HTTP/2 on the Unix socket: {what}"),
    )
}

impl<IO: AsyncRead + Unpin> AsyncRead for AuthorityFix<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.sent < this.output.len() {
                let n = (this.output.len() - this.sent).min(buf.remaining());
                buf.put_slice(&this.output[this.sent..this.sent + n]);
                this.sent += n;
                if this.sent == this.output.len() {
                    this.output.clear();
                    this.sent = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            let mut chunk = [0u8; 8192];
            let mut read = ReadBuf::new(&mut chunk);
            match Pin::new(&mut this.io).poll_read(cx, &mut read) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => {
                    if read.filled().is_empty() {
                        // What was held back (half a frame) goes as it is: the server sees
                        // the connection end where the client ended it.
                        this.eof = true;
                        this.output.append(&mut this.input);
                        continue;
                    }
                    this.input.extend_from_slice(read.filled());
                    this.process()?;
                }
            }
        }
    }
}

super::connections::only_reads_change!(AuthorityFix);

impl<IO: super::connections::Peer> super::connections::Peer for AuthorityFix<IO> {
    fn addresses(&self) -> Option<(std::net::SocketAddr, std::net::SocketAddr)> {
        self.io.addresses()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A client's HEADERS frame (with its CONTINUATIONs when `split`), encoded with an
    /// indexing HPACK encoder as clients do.
    fn client_block(
        enc: &mut loona_hpack::Encoder<'static>,
        stream: u32,
        fields: &[(&[u8], &[u8])],
        padded: bool,
        priority: bool,
        split: Option<usize>,
    ) -> Vec<u8> {
        let block = enc.encode(fields.iter().copied());
        let (first, rest) = match split {
            Some(at) => block.split_at(at.min(block.len())),
            None => (&block[..], &[][..]),
        };
        let mut payload = Vec::new();
        let mut flags = END_STREAM;
        if padded {
            flags |= PADDED;
            payload.push(3);
        }
        if priority {
            flags |= PRIORITY;
            payload.extend_from_slice(&[0, 0, 0, 0, 15]);
        }
        payload.extend_from_slice(first);
        if padded {
            payload.extend_from_slice(&[0, 0, 0]);
        }
        if rest.is_empty() {
            flags |= END_HEADERS;
        }
        let mut out = Vec::new();
        frame(HEADERS, flags, stream, &payload, &mut out);
        if !rest.is_empty() {
            frame(CONTINUATION, END_HEADERS, stream, rest, &mut out);
        }
        out
    }

    /// Frames as (type, flags, stream, payload).
    fn frames(mut bytes: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        let mut out = Vec::new();
        while !bytes.is_empty() {
            let len =
                usize::from(bytes[0]) << 16 | usize::from(bytes[1]) << 8 | usize::from(bytes[2]);
            let stream = u32::from_be_bytes([bytes[5], bytes[6], bytes[7], bytes[8]]);
            out.push((bytes[3], bytes[4], stream, bytes[9..9 + len].to_vec()));
            bytes = &bytes[9 + len..];
        }
        out
    }

    /// The header lists the server decodes from `bytes` (after the preface), with its table.
    fn server_reads(bytes: &[u8]) -> Vec<Vec<(Vec<u8>, Vec<u8>)>> {
        assert_eq!(&bytes[..PREFACE.len()], PREFACE);
        let mut dec = loona_hpack::Decoder::new();
        let mut lists = Vec::new();
        let mut block = Vec::new();
        for (kind, flags, _, payload) in frames(&bytes[PREFACE.len()..]) {
            match kind {
                HEADERS => {
                    let skip = if flags & PRIORITY != 0 { 5 } else { 0 };
                    assert_eq!(flags & PADDED, 0, "written without padding");
                    block = payload[skip..].to_vec();
                }
                CONTINUATION => block.extend_from_slice(&payload),
                _ => continue,
            }
            if flags & END_HEADERS != 0 {
                lists.push(dec.decode(&block).unwrap());
            }
        }
        lists
    }

    async fn through(input: Vec<u8>, chunk: usize) -> io::Result<Vec<u8>> {
        let (mut client, server) = tokio::io::duplex(1 << 16);
        let writer = tokio::spawn(async move {
            for part in input.chunks(chunk) {
                client.write_all(part).await.unwrap();
            }
            client.shutdown().await.unwrap();
            client
        });
        let mut fix = AuthorityFix::new(server);
        let mut out = Vec::new();
        let read = fix.read_to_end(&mut out).await;
        drop(writer.await.unwrap());
        read.map(|_| out)
    }

    fn request<'a>(authority: &'a [u8], path: &'a [u8]) -> Vec<(&'a [u8], &'a [u8])> {
        vec![
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path),
            (b":authority", authority),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ]
    }

    #[tokio::test]
    async fn a_socket_path_authority_becomes_localhost_and_the_rest_is_kept() {
        let mut enc = loona_hpack::Encoder::new();
        let mut input = PREFACE.to_vec();
        // SETTINGS and a DATA frame pass as they are.
        frame(0x4, 0, 0, &[0, 3, 0, 0, 0, 100], &mut input);
        let bad = b"%2Frun%2Fsbx%2Fsbxd.sock";
        input.extend(client_block(
            &mut enc,
            1,
            &request(bad, b"/a"),
            true,
            true,
            None,
        ));
        frame(0x0, END_STREAM, 1, b"payload", &mut input);
        // The second request's authority is an index into the client's table now.
        input.extend(client_block(
            &mut enc,
            3,
            &request(bad, b"/b"),
            false,
            false,
            Some(7),
        ));
        input.extend(client_block(
            &mut enc,
            5,
            &request(b"localhost:50051", b"/c"),
            false,
            false,
            None,
        ));
        input.extend(client_block(
            &mut enc,
            7,
            &request(b"/run/sbx/sbxd.sock", b"/d"),
            false,
            false,
            None,
        ));
        for chunk in [1, 5, 64, 1 << 16] {
            let out = through(input.clone(), chunk).await.unwrap();
            let lists = server_reads(&out);
            assert_eq!(lists.len(), 4, "chunk {chunk}");
            let authorities: Vec<&[u8]> = lists
                .iter()
                .map(|l| {
                    l.iter()
                        .find(|(n, _)| n == b":authority")
                        .unwrap()
                        .1
                        .as_slice()
                })
                .collect();
            assert_eq!(
                authorities,
                [
                    &b"localhost"[..],
                    b"localhost",
                    b"localhost:50051",
                    b"localhost"
                ],
                "chunk {chunk}"
            );
            for (list, path) in lists.iter().zip([b"/a", b"/b", b"/c", b"/d"]) {
                assert_eq!(list.len(), 6);
                assert!(list.iter().any(|(n, v)| n == b":path" && v == path));
                assert!(list.iter().any(|(n, v)| n == b"te" && v == b"trailers"));
            }
            let kinds: Vec<(u8, u8, u32)> = frames(&out[PREFACE.len()..])
                .iter()
                .map(|(k, f, s, _)| (*k, *f, *s))
                .collect();
            assert_eq!(
                kinds,
                [
                    (0x4, 0, 0),
                    (HEADERS, END_STREAM | END_HEADERS | PRIORITY, 1),
                    (0x0, END_STREAM, 1),
                    (HEADERS, END_STREAM | END_HEADERS, 3),
                    (HEADERS, END_STREAM | END_HEADERS, 5),
                    (HEADERS, END_STREAM | END_HEADERS, 7),
                ],
                "chunk {chunk}"
            );
            assert_eq!(frames(&out[PREFACE.len()..])[2].3, b"payload");
        }
    }

    #[tokio::test]
    async fn a_block_larger_than_a_frame_is_written_as_continuations() {
        let mut enc = loona_hpack::Encoder::new();
        let big = vec![b'x'; 40_000];
        let mut fields = request(b"/sock", b"/big");
        fields.push((b"x-big", &big));
        let mut input = PREFACE.to_vec();
        input.extend(client_block(
            &mut enc,
            1,
            &fields,
            false,
            false,
            Some(10_000),
        ));
        let out = through(input, 4096).await.unwrap();
        let kinds: Vec<(u8, u8)> = frames(&out[PREFACE.len()..])
            .iter()
            .map(|(k, f, _, p)| {
                assert!(p.len() <= MAX_FRAME);
                (*k, *f)
            })
            .collect();
        assert_eq!(
            kinds,
            [
                (HEADERS, END_STREAM),
                (CONTINUATION, 0),
                (CONTINUATION, END_HEADERS)
            ]
        );
        let lists = server_reads(&out);
        assert!(
            lists[0]
                .iter()
                .any(|(n, v)| n == b"x-big" && v.len() == 40_000)
        );
    }

    #[tokio::test]
    async fn what_is_not_http2_passes_and_broken_blocks_end_the_connection() {
        let http1 = b"GET / HTTP/1.1\r\nHost: /x\r\n\r\n".to_vec();
        assert_eq!(through(http1.clone(), 3).await.unwrap(), http1);

        // A header block cut by a DATA frame.
        let mut enc = loona_hpack::Encoder::new();
        let mut input = PREFACE.to_vec();
        let block = enc.encode(request(b"/s", b"/p").iter().copied());
        frame(HEADERS, 0, 1, &block[..4], &mut input);
        frame(0x0, 0, 1, b"x", &mut input);
        let err = through(input, 64).await.unwrap_err();
        assert!(err.to_string().contains("cut by another frame"), "{err}");

        // A block that does not decode: an index past both tables.
        let mut input = PREFACE.to_vec();
        frame(HEADERS, END_HEADERS, 1, &[0xff, 0x7f], &mut input);
        let err = through(input, 64).await.unwrap_err();
        assert!(err.to_string().contains("does not decode"), "{err}");

        // A frame bigger than any header block the gateway takes, refused before it is read.
        let mut input = PREFACE.to_vec();
        input.extend_from_slice(&[0x20, 0, 0, HEADERS, 0, 0, 0, 0, 1]);
        let err = through(input, 64).await.unwrap_err();
        assert!(err.to_string().contains("larger than"), "{err}");

        // A small block that decodes to a huge list: one 4 KB entry in the table, then a
        // thousand one-byte references to it (4 MB decoded).
        let mut block = Vec::new();
        block.push(0x40); // a literal with incremental indexing, a new name
        for s in [&b"x-big"[..], &[b'y'; 4000][..]] {
            loona_hpack::encoder::encode_integer_into(s.len(), 7, 0, &mut block).unwrap();
            block.extend_from_slice(s);
        }
        block.extend(std::iter::repeat_n(0x80 | 62, 1000)); // index 62: the entry just added
        let mut input = PREFACE.to_vec();
        frame(HEADERS, END_HEADERS, 1, &block, &mut input);
        let err = through(input, 4096).await.unwrap_err();
        assert!(err.to_string().contains("header list larger"), "{err}");

        // Padding past the payload.
        let mut input = PREFACE.to_vec();
        frame(HEADERS, END_HEADERS | PADDED, 1, &[9, 1, 2], &mut input);
        let err = through(input, 64).await.unwrap_err();
        assert!(err.to_string().contains("padding"), "{err}");
    }
}
