//! The node process's heap scavenger, in a process of its own: what it
//! measures (the process's resident memory) is shared by every thread, so
//! no other test may run beside it.

#![cfg(target_env = "gnu")]

use std::time::Duration;

use tessera_driver::node::heap::{anonymous_bytes, scavenge};

fn anonymous() -> u64 {
    anonymous_bytes().expect("/proc/self/statm")
}

#[tokio::test]
async fn the_scavenger_returns_memory_freed_between_live_allocations() {
    // 64 KiB blocks (below the mmap threshold, so from an arena), each
    // followed by a small one kept alive: the freed blocks cannot merge
    // into the arena's top, which glibc would return on its own, so they
    // stay resident until trimmed.
    const BLOCK: usize = 64 << 10;
    const BLOCKS: usize = 512;
    let burst = (BLOCK * BLOCKS) as u64;
    let mut blocks = Vec::with_capacity(BLOCKS);
    let mut pins = Vec::with_capacity(BLOCKS);
    for _ in 0..BLOCKS {
        blocks.push(std::hint::black_box(vec![1u8; BLOCK]));
        pins.push(Box::new(0u64));
    }
    drop(blocks);
    let freed = anonymous();
    assert!(
        anonymous() >= burst,
        "the freed blocks are still resident before any trim"
    );
    let scavenger = tokio::spawn(scavenge(Duration::from_millis(10)));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let now = anonymous();
        if freed.saturating_sub(now) >= burst * 3 / 4 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the scavenger returned {} KiB of {} KiB freed in 10 s",
            freed.saturating_sub(now) >> 10,
            burst >> 10
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    scavenger.abort();
    drop(pins);
}
