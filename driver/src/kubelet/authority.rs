//! Make the kubelet's registration calls acceptable to our HTTP/2 server.
//!
//! The kubelet dials the registration socket by its bare path, and grpc-go
//! then sends the percent-encoded socket path as the `:authority` pseudo
//! header (e.g. `var%2Flib%2Fkubelet%2F...sock`). That is not a valid URI
//! authority, and the HTTP/2 implementation under tonic resets every such
//! stream with PROTOCOL_ERROR, so registration would never succeed. (The DRA
//! service itself is dialled as `unix:<path>` by every kubelet from 1.34 on,
//! for which grpc-go sends `localhost`: its socket is not wrapped, and its
//! calls' bytes are not parsed or copied twice.)
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
mod tests;
