//! Files that are not sound snapshots are refused with a clear error, without crashing or
//! using memory out of proportion to the file.

use std::io::Write;

use tensoralloc::replay::snapshot;

fn shared_trace() -> Vec<u8> {
    std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data/traces/h100_multistream.pickle.gz"),
    )
    .unwrap()
}

fn plain_trace() -> Vec<u8> {
    snapshot::decompress(&shared_trace()).unwrap()
}

fn error_of(bytes: &[u8]) -> String {
    snapshot::parse(bytes, 0).unwrap_err().to_string()
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

#[test]
fn a_truncated_pickle_is_refused() {
    let p = plain_trace();
    for cut in [1, 2, 100, p.len() / 2, p.len() - 1] {
        let e = error_of(&p[..cut]);
        assert!(e.contains("truncated"), "cut at {cut}: {e}");
    }
}

#[test]
fn a_truncated_gzip_stream_is_refused() {
    let g = shared_trace();
    let e = error_of(&g[..g.len() / 3]);
    assert!(e.contains("damaged gzip"), "{e}");
}

#[test]
fn a_gzip_stream_with_a_bad_checksum_is_refused() {
    let mut g = shared_trace();
    let n = g.len();
    g[n - 6] ^= 0xff; // inside the CRC-32 trailer
    let e = error_of(&g);
    assert!(e.contains("damaged gzip"), "{e}");
}

#[test]
fn corrupted_bytes_inside_the_pickle_are_refused() {
    let mut p = plain_trace();
    let n = p.len();
    for i in (n / 3..n / 3 + 64).step_by(7) {
        p[i] = 0xfe;
    }
    let e = error_of(&p);
    assert!(e.contains("not a memory snapshot"), "{e}");
}

#[test]
fn a_pickle_that_names_a_global_is_refused() {
    // What `pickle.dumps(os.system)` looks like at protocol 4.
    let e = error_of(
        b"\x80\x04\x95\x11\x00\x00\x00\x00\x00\x00\x00\x8c\x05posix\x94\x8c\x06system\x94\x93\x94.",
    );
    assert!(e.contains("global"), "{e}");
}

#[test]
fn a_pickle_that_calls_a_constructor_is_refused() {
    // `(1,)` then REDUCE on it.
    let e = error_of(b"\x80\x02K\x01\x85K\x01\x85R.");
    assert!(e.contains("refused"), "{e}");
}

#[test]
fn a_huge_announced_string_length_is_refused_without_allocating_it() {
    let mut p = b"\x80\x04\x8d".to_vec();
    p.extend_from_slice(&(1u64 << 62).to_le_bytes());
    p.extend_from_slice(b"abc.");
    let e = error_of(&p);
    assert!(e.contains("truncated"), "{e}");
}

#[test]
fn a_gzip_bomb_is_refused_after_the_size_limit() {
    // 1.1 GiB of zeros compress to about a megabyte.
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    let zeros = vec![0u8; 1 << 20];
    for _ in 0..(snapshot::MAX_PICKLE_BYTES >> 20) + 1 {
        e.write_all(&zeros).unwrap();
    }
    let bomb = e.finish().unwrap();
    let err = error_of(&bomb);
    assert!(err.contains("decompresses to more than"), "{err}");
}

#[test]
fn a_pickle_of_something_else_is_refused() {
    // A list of numbers, gzip-compressed.
    let e = error_of(&gzip(b"\x80\x02]q\x00(K\x01K\x02e."));
    assert!(e.contains("not a memory snapshot"), "{e}");
}

#[test]
fn a_text_file_is_refused() {
    let e = error_of(b"segments, device_traces\n");
    assert!(e.contains("not a pickle"), "{e}");
}

#[test]
fn a_device_the_snapshot_lacks_is_refused() {
    let e = snapshot::parse(&shared_trace(), 3).unwrap_err().to_string();
    assert!(e.contains("device 3"), "{e}");
}
