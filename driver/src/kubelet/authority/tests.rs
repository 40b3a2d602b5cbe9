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
async fn read_until_failure(wrapped: &mut AuthorityRewrite<tokio::io::DuplexStream>) -> io::Error {
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
