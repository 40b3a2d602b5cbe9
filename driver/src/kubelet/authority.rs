//! Make the kubelet's registration calls acceptable to our HTTP/2 server.
//!
//! The kubelet dials the registration socket by its bare path, and grpc-go
//! then sends the percent-encoded socket path as the `:authority` pseudo
//! header (e.g. `var%2Flib%2Fkubelet%2F...sock`). That is not a valid URI
//! authority, and the HTTP/2 implementation under tonic resets every such
//! stream with PROTOCOL_ERROR, so registration would never succeed. (The DRA
//! service itself is dialled as `unix:<path>`, for which grpc-go sends
//! `localhost`.)
//!
//! On a Unix socket the authority means nothing, so this module rewrites it on
//! the way in: [`AuthorityRewrite`] wraps an accepted connection and replaces
//! every literal `:authority` in the client's header blocks with `localhost`.
//! Only header-block framing and HPACK field boundaries are parsed; all other
//! bytes pass through untouched. Anything that does not parse as HTTP/2 is
//! passed through unchanged, so the server reports the real error.
//!
//! Nothing is buffered beyond what the server itself would accept: a frame
//! longer than the server's SETTINGS_MAX_FRAME_SIZE, or a header block
//! (HEADERS and its CONTINUATION frames) longer than [`MAX_HEADER_BLOCK`],
//! fails the connection before its bytes are collected, so a peer cannot make
//! us hold 16 MiB frames or an endless CONTINUATION sequence in memory ahead
//! of the HTTP/2 server's own limits.
//!
//! HPACK dynamic-table consistency: a rewritten field keeps its representation
//! (incremental indexing stays incremental indexing), so client and server
//! add an entry at the same position; later indexed references resolve to
//! the replacement on the server. The server's entry is never larger than the
//! client's (an authority shorter than `localhost` is replaced by as much of
//! `localhost` as fits in it), so the server evicts no earlier than the client
//! does and every index the client uses still names the same entry.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::wrappers::UnixListenerStream;
use tokio_stream::{Stream, StreamExt as _};
use tonic::transport::server::Connected;
use tracing::warn;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER_LEN: usize = 9;
const TYPE_HEADERS: u8 = 0x1;
const TYPE_CONTINUATION: u8 = 0x9;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;
/// The smallest SETTINGS_MAX_FRAME_SIZE a peer may use, and the one our
/// server advertises (hyper's default, which tonic keeps): a longer frame is
/// refused. Re-emitted header blocks are split to fit it.
const MAX_FRAME: usize = 16_384;
/// The longest header block (HPACK-coded, across CONTINUATION frames) let
/// through. The server decodes at most 16 KiB of header list; a kubelet's
/// blocks are a few hundred bytes.
const MAX_HEADER_BLOCK: usize = 64 * 1024;
/// Static-table index of `:authority` (RFC 7541, appendix A).
const AUTHORITY_INDEX: u64 = 1;
const REPLACEMENT: &[u8] = b"localhost";

/// Accepted connections of `listener`, each wrapped in [`AuthorityRewrite`].
pub fn incoming(
    listener: UnixListener,
) -> impl Stream<Item = io::Result<AuthorityRewrite<UnixStream>>> {
    UnixListenerStream::new(listener).map(|conn| conn.map(AuthorityRewrite::new))
}

/// A connection whose inbound HTTP/2 header blocks get `:authority` rewritten.
pub struct AuthorityRewrite<S> {
    inner: S,
    rewriter: Rewriter,
    /// Transformed bytes not yet handed to the reader.
    ready: Vec<u8>,
    ready_pos: usize,
    eof: bool,
    /// Why the connection was failed; every later read fails with it.
    refused: Option<Refused>,
}

impl<S> AuthorityRewrite<S> {
    pub fn new(inner: S) -> Self {
        AuthorityRewrite {
            inner,
            rewriter: Rewriter::default(),
            ready: Vec::new(),
            ready_pos: 0,
            eof: false,
            refused: None,
        }
    }
}

impl<S: Connected> Connected for AuthorityRewrite<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityRewrite<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.ready_pos < this.ready.len() {
                let n = buf.remaining().min(this.ready.len() - this.ready_pos);
                buf.put_slice(&this.ready[this.ready_pos..this.ready_pos + n]);
                this.ready_pos += n;
                if this.ready_pos == this.ready.len() {
                    this.ready.clear();
                    this.ready_pos = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if let Some(refused) = &this.refused {
                return Poll::Ready(Err(refused.to_io()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            let mut chunk = [0u8; 8192];
            let mut read = ReadBuf::new(&mut chunk);
            match Pin::new(&mut this.inner).poll_read(cx, &mut read) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) if read.filled().is_empty() => {
                    // Hand over whatever was held back (an incomplete frame)
                    // so the server sees the truncation itself.
                    this.ready.extend(this.rewriter.finish());
                    this.eof = true;
                }
                Poll::Ready(Ok(())) => {
                    if let Err(refused) = this.rewriter.push(read.filled(), &mut this.ready) {
                        warn!("closing a plugin socket connection: {refused}");
                        // What was rewritten before stays unread: the
                        // connection is over.
                        this.ready.clear();
                        this.ready_pos = 0;
                        this.refused = Some(refused);
                    }
                }
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityRewrite<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// Why a connection's input was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Refused {
    /// A frame announced longer than [`MAX_FRAME`].
    FrameTooLong(usize),
    /// A header block growing past [`MAX_HEADER_BLOCK`].
    HeaderBlockTooLong(usize),
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::FrameTooLong(len) => write!(
                f,
                "HTTP/2 frame of {len} bytes, longer than the {MAX_FRAME} bytes the server accepts"
            ),
            Refused::HeaderBlockTooLong(len) => write!(
                f,
                "HTTP/2 header block of {len} bytes or more (HEADERS and CONTINUATION frames), \
                 longer than the {MAX_HEADER_BLOCK} bytes let through"
            ),
        }
    }
}

impl Refused {
    fn to_io(&self) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, self.to_string())
    }
}

/// The byte-stream transformer, independent of any I/O.
#[derive(Default)]
struct Rewriter {
    pending: Vec<u8>,
    state: State,
    /// A header block being collected: HEADERS frame header + payload
    /// prefix (priority) and the fragments so far.
    block: Option<PendingBlock>,
}

#[derive(Default, PartialEq, Eq)]
enum State {
    #[default]
    Preface,
    Frames,
    /// Not HTTP/2 as expected: stop interpreting.
    Passthrough,
}

struct PendingBlock {
    stream_id: [u8; 4],
    flags: u8,
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
    /// The frames as received, used if the block cannot be parsed.
    original: Vec<u8>,
}

impl Rewriter {
    /// Transforms `input` into `out`; refuses a frame or header block too
    /// long to hold (the connection must then end).
    fn push(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<(), Refused> {
        if self.state == State::Passthrough {
            out.extend_from_slice(input);
            return Ok(());
        }
        self.pending.extend_from_slice(input);
        let mut pos = 0;
        loop {
            match self.state {
                State::Passthrough => {
                    out.extend_from_slice(&self.pending[pos..]);
                    pos = self.pending.len();
                    break;
                }
                State::Preface => {
                    let have = &self.pending[pos..];
                    let n = have.len().min(PREFACE.len());
                    if have[..n] != PREFACE[..n] {
                        self.state = State::Passthrough;
                        continue;
                    }
                    if n < PREFACE.len() {
                        break;
                    }
                    out.extend_from_slice(PREFACE);
                    pos += PREFACE.len();
                    self.state = State::Frames;
                }
                State::Frames => {
                    let have = &self.pending[pos..];
                    if have.len() < FRAME_HEADER_LEN {
                        break;
                    }
                    let len = (usize::from(have[0]) << 16)
                        | (usize::from(have[1]) << 8)
                        | usize::from(have[2]);
                    if len > MAX_FRAME {
                        return Err(Refused::FrameTooLong(len));
                    }
                    let total = FRAME_HEADER_LEN + len;
                    if have.len() < total {
                        break;
                    }
                    let frame = have[..total].to_vec();
                    pos += total;
                    self.frame(&frame, out)?;
                }
            }
        }
        self.pending.drain(..pos);
        Ok(())
    }

    /// Bytes held back at end of stream, unchanged.
    fn finish(&mut self) -> Vec<u8> {
        let mut rest = self.block.take().map(|b| b.original).unwrap_or_default();
        rest.append(&mut self.pending);
        rest
    }

    fn frame(&mut self, frame: &[u8], out: &mut Vec<u8>) -> Result<(), Refused> {
        let kind = frame[3];
        let flags = frame[4];
        let payload = &frame[FRAME_HEADER_LEN..];
        match (kind, self.block.as_mut()) {
            (TYPE_CONTINUATION, Some(block)) => {
                let collected = block.original.len() + frame.len();
                if collected > MAX_HEADER_BLOCK {
                    return Err(Refused::HeaderBlockTooLong(collected));
                }
                block.fragment.extend_from_slice(payload);
                block.original.extend_from_slice(frame);
                if flags & FLAG_END_HEADERS != 0 {
                    let block = self.block.take().expect("block present");
                    emit_block(block, out);
                }
            }
            (TYPE_HEADERS, None) => match header_fragment(flags, payload) {
                Some((priority, fragment)) => {
                    let block = PendingBlock {
                        stream_id: [frame[5], frame[6], frame[7], frame[8]],
                        flags,
                        priority,
                        fragment: fragment.to_vec(),
                        original: frame.to_vec(),
                    };
                    if flags & FLAG_END_HEADERS != 0 {
                        emit_block(block, out);
                    } else {
                        self.block = Some(block);
                    }
                }
                None => self.give_up(frame, out),
            },
            // Anything else inside a header block is a protocol error the
            // server must see as such.
            (_, Some(_)) => self.give_up(frame, out),
            (_, None) => out.extend_from_slice(frame),
        }
        Ok(())
    }

    fn give_up(&mut self, frame: &[u8], out: &mut Vec<u8>) {
        if let Some(block) = self.block.take() {
            out.extend_from_slice(&block.original);
        }
        out.extend_from_slice(frame);
        self.state = State::Passthrough;
    }
}

/// Split a HEADERS payload into its priority fields and block fragment,
/// dropping padding.
fn header_fragment(flags: u8, payload: &[u8]) -> Option<(Option<[u8; 5]>, &[u8])> {
    let mut body = payload;
    let mut pad = 0usize;
    if flags & FLAG_PADDED != 0 {
        pad = usize::from(*body.first()?);
        body = &body[1..];
    }
    let mut priority = None;
    if flags & FLAG_PRIORITY != 0 {
        priority = Some(body.get(..5)?.try_into().ok()?);
        body = &body[5..];
    }
    let end = body.len().checked_sub(pad)?;
    Some((priority, &body[..end]))
}

fn emit_block(block: PendingBlock, out: &mut Vec<u8>) {
    let Some(fragment) = rewrite_authority(&block.fragment) else {
        out.extend_from_slice(&block.original);
        return;
    };
    let mut first_payload = Vec::with_capacity(fragment.len() + 5);
    if let Some(p) = block.priority {
        first_payload.extend_from_slice(&p);
    }
    let keep = block.flags & !(FLAG_PADDED | FLAG_END_HEADERS);
    let first_room = MAX_FRAME - first_payload.len();
    let (head, mut rest) = fragment.split_at(fragment.len().min(first_room));
    first_payload.extend_from_slice(head);
    let end = if rest.is_empty() { FLAG_END_HEADERS } else { 0 };
    write_frame(
        out,
        TYPE_HEADERS,
        keep | end,
        block.stream_id,
        &first_payload,
    );
    while !rest.is_empty() {
        let (chunk, tail) = rest.split_at(rest.len().min(MAX_FRAME));
        rest = tail;
        let end = if rest.is_empty() { FLAG_END_HEADERS } else { 0 };
        write_frame(out, TYPE_CONTINUATION, end, block.stream_id, chunk);
    }
}

fn write_frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: [u8; 4], payload: &[u8]) {
    let len = payload.len();
    out.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags]);
    out.extend_from_slice(&stream);
    out.extend_from_slice(payload);
}

/// Rewrite every literal `:authority` field of an HPACK header block to
/// `localhost`. `None` if the block does not parse (left to the server).
fn rewrite_authority(block: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(block.len());
    let mut pos = 0;
    while pos < block.len() {
        let start = pos;
        let first = block[pos];
        if first & 0x80 != 0 {
            // Indexed field: a reference, nothing literal to rewrite.
            decode_int(block, &mut pos, 7)?;
            out.extend_from_slice(&block[start..pos]);
            continue;
        }
        if first & 0xe0 == 0x20 {
            // Dynamic table size update.
            decode_int(block, &mut pos, 5)?;
            out.extend_from_slice(&block[start..pos]);
            continue;
        }
        // A literal field: incremental indexing (01), or without / never
        // indexed (0000 / 0001).
        let (prefix_bits, pattern) = if first & 0xc0 == 0x40 {
            (6, first & 0xc0)
        } else {
            (4, first & 0xf0)
        };
        let name_index = decode_int(block, &mut pos, prefix_bits)?;
        let name_start = pos;
        let literal_authority_name = if name_index == 0 {
            let (huffman, name) = decode_string(block, &mut pos)?;
            !huffman && name == b":authority"
        } else {
            false
        };
        let value_start = pos;
        let (huffman, value) = decode_string(block, &mut pos)?;
        let indexed = pattern == 0x40;
        let replacement = replacement(huffman, value, indexed);
        if (name_index == AUTHORITY_INDEX || literal_authority_name) && !replacement.is_empty() {
            if name_index == 0 {
                out.push(pattern);
                out.extend_from_slice(&block[name_start..value_start]);
            } else {
                encode_int(&mut out, pattern, prefix_bits, AUTHORITY_INDEX);
            }
            encode_int(&mut out, 0, 7, replacement.len() as u64);
            out.extend_from_slice(replacement);
        } else {
            out.extend_from_slice(&block[start..pos]);
        }
    }
    Some(out)
}

/// The authority written in place of `value`. A field added to the dynamic
/// table (`indexed`) must not make the server's entry larger than the
/// client's, whose size counts the decoded value: as much of `localhost` as
/// the value surely decodes to. Empty: left as it is.
fn replacement(huffman: bool, value: &[u8], indexed: bool) -> &'static [u8] {
    if !indexed {
        return REPLACEMENT;
    }
    let decoded_at_least = if huffman {
        // Huffman codes are 5 to 30 bits long, the padding under 8 bits.
        (value.len() * 8).saturating_sub(7).div_ceil(30)
    } else {
        value.len()
    };
    &REPLACEMENT[..decoded_at_least.min(REPLACEMENT.len())]
}

/// HPACK integer with an N-bit prefix (RFC 7541 section 5.1).
fn decode_int(buf: &[u8], pos: &mut usize, prefix_bits: u8) -> Option<u64> {
    let max = (1u64 << prefix_bits) - 1;
    let mut value = u64::from(*buf.get(*pos)?) & max;
    *pos += 1;
    if value < max {
        return Some(value);
    }
    let mut shift = 0u32;
    loop {
        let byte = *buf.get(*pos)?;
        *pos += 1;
        value = value.checked_add(u64::from(byte & 0x7f).checked_shl(shift)?)?;
        if byte & 0x80 == 0 {
            return Some(value);
        }
        shift += 7;
        if shift > 56 {
            return None;
        }
    }
}

fn encode_int(out: &mut Vec<u8>, high_bits: u8, prefix_bits: u8, mut value: u64) {
    let max = (1u64 << prefix_bits) - 1;
    if value < max {
        out.push(high_bits | value as u8);
        return;
    }
    out.push(high_bits | max as u8);
    value -= max;
    while value >= 0x80 {
        out.push((value as u8 & 0x7f) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// An HPACK string literal: (huffman-coded?, raw bytes).
fn decode_string<'a>(buf: &'a [u8], pos: &mut usize) -> Option<(bool, &'a [u8])> {
    let huffman = buf.get(*pos)? & 0x80 != 0;
    let len = usize::try_from(decode_int(buf, pos, 7)?).ok()?;
    let bytes = buf.get(*pos..pos.checked_add(len)?)?;
    *pos += len;
    Some((huffman, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn string(out: &mut Vec<u8>, s: &[u8]) {
        encode_int(out, 0, 7, s.len() as u64);
        out.extend_from_slice(s);
    }

    /// What grpc-go sends for a bare socket path: `:method POST` (indexed),
    /// `:scheme http` (indexed), `:path` literal, `:authority` literal with
    /// incremental indexing and the percent-encoded path as value.
    fn grpc_go_block(authority: &[u8]) -> Vec<u8> {
        let mut b = vec![0x83, 0x86];
        b.push(0x44); // :path, incremental indexing, static name 4
        string(&mut b, b"/pluginregistration.Registration/GetInfo");
        b.push(0x41); // :authority, incremental indexing, static name 1
        string(&mut b, authority);
        b.push(0x40); // literal new name
        string(&mut b, b"content-type");
        string(&mut b, b"application/grpc");
        b
    }

    fn headers_frame(flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = Vec::new();
        write_frame(&mut f, TYPE_HEADERS, flags, stream.to_be_bytes(), payload);
        f
    }

    #[test]
    fn percent_encoded_socket_path_becomes_localhost() {
        let block = grpc_go_block(b"var%2Flib%2Fkubelet%2Fplugins_registry%2Fx-reg.sock");
        let rewritten = rewrite_authority(&block).unwrap();
        let expected = grpc_go_block(b"localhost");
        assert_eq!(rewritten, expected);
    }

    /// The size HPACK counts for a `:authority` table entry of a value
    /// (RFC 7541 section 4.1), raw or Huffman-coded (its fewest symbols).
    fn entry_size(huffman: bool, raw_len: usize) -> usize {
        let decoded = if huffman {
            (raw_len * 8).saturating_sub(7).div_ceil(30)
        } else {
            raw_len
        };
        ":authority".len() + decoded + 32
    }

    #[test]
    fn an_indexed_authority_never_grows_the_servers_table() {
        for len in 1..40 {
            for huffman in [false, true] {
                let value = vec![b'a'; len];
                let mut block = vec![0x41]; // incremental indexing, name 1
                encode_int(&mut block, if huffman { 0x80 } else { 0 }, 7, len as u64);
                block.extend_from_slice(&value);
                let out = rewrite_authority(&block).unwrap();
                let mut pos = 1;
                let (out_huffman, written) = decode_string(&out, &mut pos).unwrap();
                assert!(!out_huffman);
                assert!(
                    entry_size(false, written.len()) <= entry_size(huffman, len),
                    "len {len} huffman {huffman}: wrote {:?}",
                    String::from_utf8_lossy(written)
                );
                assert!(REPLACEMENT.starts_with(written));
            }
        }
        // A short one written raw: as much of localhost as fits.
        let mut block = vec![0x41];
        string(&mut block, b"a.sock");
        let mut expected = vec![0x41];
        string(&mut expected, b"localh");
        assert_eq!(rewrite_authority(&block).unwrap(), expected);
        // Not added to the table: any size goes.
        let mut block = vec![0x01]; // without indexing, name 1
        string(&mut block, b"a");
        let mut expected = vec![0x01];
        string(&mut expected, b"localhost");
        assert_eq!(rewrite_authority(&block).unwrap(), expected);
    }

    #[test]
    fn literal_name_and_never_indexed_forms_are_rewritten() {
        let mut block = vec![0x10]; // never indexed, new name
        string(&mut block, b":authority");
        string(&mut block, b"/run/x.sock");
        let out = rewrite_authority(&block).unwrap();
        let mut expected = vec![0x10];
        string(&mut expected, b":authority");
        string(&mut expected, b"localhost");
        assert_eq!(out, expected);
    }

    #[test]
    fn truncated_blocks_are_not_parsed() {
        let block = grpc_go_block(b"x%2Fy");
        assert!(rewrite_authority(&block[..block.len() - 3]).is_none());
    }

    #[test]
    fn stream_is_rewritten_across_chunk_boundaries_and_continuations() {
        let block = grpc_go_block(b"a%2Fb.sock");
        let (part1, part2) = block.split_at(7);
        let mut input = PREFACE.to_vec();
        // SETTINGS frame passes through untouched.
        write_frame(&mut input, 0x4, 0, [0; 4], &[0, 3, 0, 0, 0, 100]);
        // HEADERS (padded, with priority) + CONTINUATION.
        let mut payload = vec![2]; // pad length
        payload.extend_from_slice(&[0x80, 0, 0, 0, 15]);
        payload.extend_from_slice(part1);
        payload.extend_from_slice(&[0, 0]);
        input.extend(headers_frame(FLAG_PADDED | FLAG_PRIORITY, 1, &payload));
        write_frame(
            &mut input,
            TYPE_CONTINUATION,
            FLAG_END_HEADERS,
            1u32.to_be_bytes(),
            part2,
        );
        // DATA frame passes through.
        write_frame(&mut input, 0x0, 0x1, 1u32.to_be_bytes(), b"hello");

        let mut rewriter = Rewriter::default();
        let mut out = Vec::new();
        for chunk in input.chunks(5) {
            rewriter.push(chunk, &mut out).unwrap();
        }
        assert!(rewriter.finish().is_empty());

        let mut expected = PREFACE.to_vec();
        write_frame(&mut expected, 0x4, 0, [0; 4], &[0, 3, 0, 0, 0, 100]);
        let mut payload = vec![0x80, 0, 0, 0, 15];
        payload.extend(grpc_go_block(b"localhost"));
        expected.extend(headers_frame(FLAG_PRIORITY | FLAG_END_HEADERS, 1, &payload));
        write_frame(&mut expected, 0x0, 0x1, 1u32.to_be_bytes(), b"hello");
        assert_eq!(out, expected);
    }

    #[test]
    fn non_http2_input_passes_through() {
        let mut rewriter = Rewriter::default();
        let mut out = Vec::new();
        rewriter.push(b"GET / HTTP/1.1\r\n\r\n", &mut out).unwrap();
        assert_eq!(out, b"GET / HTTP/1.1\r\n\r\n");
    }

    #[test]
    fn large_integers_round_trip() {
        for v in [0u64, 30, 31, 62, 63, 64, 127, 128, 300, 16_384, 1 << 40] {
            let mut buf = Vec::new();
            encode_int(&mut buf, 0x40, 6, v);
            let mut pos = 0;
            assert_eq!(decode_int(&buf, &mut pos, 6), Some(v));
            assert_eq!(pos, buf.len());
        }
    }

    #[tokio::test]
    async fn wraps_an_async_stream() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut client, server) = tokio::io::duplex(64);
        let mut input = PREFACE.to_vec();
        input.extend(headers_frame(
            FLAG_END_HEADERS,
            1,
            &grpc_go_block(b"run%2Fx.sock"),
        ));
        let writer = tokio::spawn(async move {
            client.write_all(&input).await.unwrap();
            client.shutdown().await.unwrap();
        });
        let mut wrapped = AuthorityRewrite::new(server);
        let mut out = Vec::new();
        wrapped.read_to_end(&mut out).await.unwrap();
        writer.await.unwrap();
        let mut expected = PREFACE.to_vec();
        expected.extend(headers_frame(
            FLAG_END_HEADERS,
            1,
            &grpc_go_block(b"localhost"),
        ));
        assert_eq!(out, expected);
    }
    /// The bytes of a frame header announcing `len` bytes of payload.
    fn frame_header(len: usize, kind: u8, flags: u8, stream: u32) -> Vec<u8> {
        let mut h = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        h.extend_from_slice(&stream.to_be_bytes());
        h
    }

    /// Reads `wrapped` to its end or first error; a stalled read (input
    /// held back waiting for more) fails the test.
    async fn read_until_failure(
        wrapped: &mut AuthorityRewrite<tokio::io::DuplexStream>,
    ) -> io::Error {
        use tokio::io::AsyncReadExt;
        let mut sink = vec![0u8; 4096];
        let reading = async {
            loop {
                match wrapped.read(&mut sink).await {
                    Ok(0) => panic!("the connection ended without being refused"),
                    Ok(_) => {}
                    Err(e) => return e,
                }
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(10), reading)
            .await
            .expect("the input was held back instead of refused")
    }

    #[tokio::test]
    async fn a_frame_longer_than_the_server_accepts_fails_the_connection_unread() {
        use tokio::io::AsyncWriteExt;
        let (mut client, server) = tokio::io::duplex(1 << 16);
        let mut input = PREFACE.to_vec();
        // A DATA frame announcing 16 MiB - 1, of which a few bytes come.
        input.extend(frame_header((1 << 24) - 1, 0x0, 0, 1));
        input.extend_from_slice(&[0; 100]);
        client.write_all(&input).await.unwrap();
        let mut wrapped = AuthorityRewrite::new(server);
        let e = read_until_failure(&mut wrapped).await;
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("frame of 16777215 bytes"), "{e}");
        // The client is still connected: the refusal did not wait for it.
        drop(client);
    }

    #[tokio::test]
    async fn an_endless_continuation_sequence_fails_the_connection() {
        use tokio::io::AsyncWriteExt;
        let (mut client, server) = tokio::io::duplex(1 << 16);
        let writer = tokio::spawn(async move {
            let mut start = PREFACE.to_vec();
            start.extend(headers_frame(0, 1, &grpc_go_block(b"x%2Fy")));
            client.write_all(&start).await?;
            // 64 MiB of CONTINUATION frames, none ending the block; the
            // write fails once the reader is gone.
            let mut continuation = frame_header(MAX_FRAME, TYPE_CONTINUATION, 0, 1);
            continuation.resize(FRAME_HEADER_LEN + MAX_FRAME, 0x82);
            for _ in 0..(1 << 12) {
                client.write_all(&continuation).await?;
            }
            io::Result::Ok(client)
        });
        let mut wrapped = AuthorityRewrite::new(server);
        let e = read_until_failure(&mut wrapped).await;
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("header block of"), "{e}");
        // Read again: still refused, nothing more is taken in.
        assert_eq!(
            read_until_failure(&mut wrapped).await.kind(),
            io::ErrorKind::InvalidData
        );
        drop(wrapped);
        assert!(writer.await.unwrap().is_err(), "the writer was cut off");
    }

    #[test]
    fn a_header_block_is_refused_as_it_passes_the_limit() {
        let mut rewriter = Rewriter::default();
        let mut out = Vec::new();
        let mut input = PREFACE.to_vec();
        input.extend(headers_frame(0, 1, &grpc_go_block(b"x%2Fy")));
        rewriter.push(&input, &mut out).unwrap();
        let mut continuation = frame_header(MAX_FRAME, TYPE_CONTINUATION, 0, 1);
        continuation.resize(FRAME_HEADER_LEN + MAX_FRAME, 0x82);
        let mut refused = None;
        for sent in 1..100 {
            if let Err(e) = rewriter.push(&continuation, &mut out) {
                refused = Some((sent, e));
                break;
            }
            let held = rewriter.block.as_ref().map_or(0, |b| b.original.len());
            assert!(held <= MAX_HEADER_BLOCK, "{held} bytes held");
        }
        let (sent, e) = refused.expect("refused");
        assert_eq!(
            sent,
            MAX_HEADER_BLOCK / MAX_FRAME,
            "refused at the frame passing the limit"
        );
        assert!(matches!(e, Refused::HeaderBlockTooLong(n) if n > MAX_HEADER_BLOCK));
        assert_eq!(out, PREFACE, "nothing of the block was passed on");
    }
}
