//! The caching memory pool over a fake device: rounding and size classes, reuse, splitting and
//! merging, stream separation, statistics, cache release and out-of-memory recovery.

use rustytorch_runtime::pool::{Block, FakeAllocator, Pool, PoolError};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

fn pool(capacity: usize) -> Pool<FakeAllocator> {
    Pool::new(FakeAllocator::new(capacity), "fake:0".to_string())
}

#[test]
fn sizes_are_rounded_to_512_bytes() {
    let mut p = pool(1 << 30);
    for (req, size) in [(1, 512), (512, 512), (513, 1024), (1000, 1024), (MIB, MIB)] {
        let b = p.alloc(req, 0).unwrap();
        assert_eq!((b.size, b.requested), (size, req), "request {req}");
    }
    let s = p.stats();
    assert_eq!(
        s.allocated_bytes.current,
        (512 + 512 + 1024 + 1024 + MIB) as u64
    );
    assert_eq!(
        s.requested_bytes.current,
        (1 + 512 + 513 + 1000 + MIB) as u64
    );
}

#[test]
fn segment_sizes_follow_the_size_classes() {
    // (request, segment the pool must allocate for it)
    for (req, seg) in [
        (1, 2 * MIB),
        (MIB, 2 * MIB),
        (MIB + 1, 20 * MIB),
        (10 * MIB - 512, 20 * MIB),
        (10 * MIB, 10 * MIB),
        (11 * MIB + 1, 12 * MIB),
    ] {
        let mut p = pool(1 << 30);
        p.alloc(req, 0).unwrap();
        assert_eq!(p.allocator().in_use, seg, "request {req}");
        assert_eq!(
            p.stats().reserved_bytes.current,
            seg as u64,
            "request {req}"
        );
        assert_eq!(p.stats().segment.current, 1);
    }
}

#[test]
fn zero_bytes_need_no_memory() {
    let mut p = pool(MIB);
    let b = p.alloc(0, 3).unwrap();
    assert_eq!((b.addr, b.size, b.requested, b.stream()), (0, 0, 0, 3));
    p.free(b);
    assert_eq!(p.allocator().allocs, 0);
    assert_eq!(p.stats(), Default::default());
}

#[test]
fn small_pool_splits_down_to_512_bytes() {
    let mut p = pool(1 << 30);
    let a = p.alloc(MIB, 0).unwrap();
    let b = p.alloc(MIB - 512, 0).unwrap();
    let c = p.alloc(1, 0).unwrap();
    assert_eq!(b.addr, a.addr + MIB as u64);
    assert_eq!(c.addr, b.addr + (MIB - 512) as u64);
    assert_eq!(c.size, 512);
    assert_eq!(
        p.allocator().allocs,
        1,
        "all three fit in one 2 MiB segment"
    );
    assert_eq!(p.stats().free_cached_bytes, 0);
}

#[test]
fn large_pool_splits_only_beyond_1_mib() {
    let mut p = pool(1 << 30);
    // 19.5 MiB gets a 20 MiB segment; the 0.5 MiB rest is not split off.
    let a = p.alloc(19 * MIB + 512 * KIB, 0).unwrap();
    assert_eq!(a.size, 20 * MIB);
    assert_eq!(p.stats().allocated_bytes.current, 20 * MIB as u64);
    assert_eq!(
        p.stats().requested_bytes.current,
        (19 * MIB + 512 * KIB) as u64
    );
    // 1.5 MiB from a 20 MiB segment leaves 18.5 MiB: split.
    let b = p.alloc(MIB + 512 * KIB, 0).unwrap();
    assert_eq!(b.size, MIB + 512 * KIB);
    let c = p.alloc(18 * MIB, 0).unwrap();
    assert_eq!(c.addr, b.addr + b.size as u64);
    // c took 18 of the remaining 18.5 MiB whole: a 0.5 MiB rest is not split in the large pool.
    assert_eq!(c.size, 18 * MIB + 512 * KIB);
    assert_eq!(p.allocator().allocs, 2);
}

#[test]
fn a_freed_block_is_reused() {
    let mut p = pool(1 << 30);
    let a = p.alloc(1000, 0).unwrap();
    let addr = a.addr;
    p.free(a);
    let b = p.alloc(900, 0).unwrap();
    assert_eq!(b.addr, addr);
    let big = p.alloc(5 * MIB, 0).unwrap();
    let big_addr = big.addr;
    p.free(big);
    assert_eq!(p.alloc(4 * MIB, 0).unwrap().addr, big_addr);
    assert_eq!(p.allocator().allocs, 2, "one small and one large segment");
    assert_eq!(p.stats().num_device_alloc, 2);
}

#[test]
fn best_fit_takes_the_smallest_free_block_that_fits() {
    let mut p = pool(1 << 30);
    let a = p.alloc(512 * KIB, 0).unwrap();
    let _keep1 = p.alloc(512, 0).unwrap();
    let b = p.alloc(64 * KIB, 0).unwrap();
    let _keep2 = p.alloc(512, 0).unwrap();
    let b_addr = b.addr;
    p.free(a);
    p.free(b);
    // Free: 512 KiB (lowest address), 64 KiB, and the segment's tail; 60 KiB fits best in b.
    assert_eq!(p.alloc(60 * KIB, 0).unwrap().addr, b_addr);
}

#[test]
fn freeing_merges_neighbours() {
    let mut p = pool(1 << 30);
    let a = p.alloc(256 * KIB, 0).unwrap();
    let b = p.alloc(256 * KIB, 0).unwrap();
    let c = p.alloc(256 * KIB, 0).unwrap();
    assert_eq!(b.addr, a.addr + (256 * KIB) as u64);
    assert_eq!(c.addr, b.addr + (256 * KIB) as u64);
    let a_addr = a.addr;
    let tail = (2 * MIB - 768 * KIB) as u64;

    p.free(b);
    let s = p.stats();
    assert_eq!(s.inactive_split, 2, "b and the tail");
    assert_eq!(s.inactive_split_bytes, 256 * KIB as u64 + tail);

    p.free(a);
    let s = p.stats();
    assert_eq!(s.inactive_split, 2, "a+b merged, and the tail");
    assert_eq!(s.inactive_split_bytes, 512 * KIB as u64 + tail);
    assert_eq!(s.free_cached_bytes, 512 * KIB as u64 + tail);

    // The merged a+b block serves a request of their combined size.
    let ab = p.alloc(512 * KIB, 0).unwrap();
    assert_eq!((ab.addr, ab.size), (a_addr, 512 * KIB));
    p.free(ab);

    // Freeing c joins everything into one free segment: nothing is split any more.
    p.free(c);
    let s = p.stats();
    assert_eq!((s.inactive_split, s.inactive_split_bytes), (0, 0));
    assert_eq!(s.largest_free_block, 2 * MIB as u64);
    assert_eq!(s.free_cached_bytes, 2 * MIB as u64);
    assert_eq!(s.fragmentation, 0.0);
    let whole = p.alloc(MIB, 0).unwrap();
    assert_eq!(whole.addr, a_addr);
    assert_eq!(p.allocator().allocs, 1);
}

#[test]
fn blocks_are_reused_only_on_their_stream() {
    let mut p = pool(1 << 30);
    let a = p.alloc(1000, 1).unwrap();
    let a_addr = a.addr;
    p.free(a);
    let b = p.alloc(1000, 2).unwrap();
    assert_ne!(b.addr, a_addr, "stream 2 must not get stream 1's block");
    assert_eq!(b.stream(), 2);
    assert_eq!(p.allocator().allocs, 2, "stream 2 needs its own segment");
    // Stream 2's segment does not serve stream 1 either; stream 1 gets its block back.
    let c = p.alloc(1000, 1).unwrap();
    assert_eq!(c.addr, a_addr);
    // The same holds in the large pool, from stream 2 to stream 1 as well.
    let d = p.alloc(3 * MIB, 2).unwrap();
    let d_addr = d.addr;
    p.free(d);
    let e = p.alloc(3 * MIB, 1).unwrap();
    assert_ne!(e.addr, d_addr, "stream 1 must not get stream 2's block");
    assert_eq!(p.allocator().allocs, 4);
    p.free(e);
    assert_eq!(p.alloc(3 * MIB, 2).unwrap().addr, d_addr);
}

#[test]
fn current_and_peak_accounting() {
    let mut p = pool(1 << 30);
    let a = p.alloc(3 * MIB, 0).unwrap();
    let b = p.alloc(5 * MIB - 100, 0).unwrap();
    p.free(a);
    let c = p.alloc(MIB, 0).unwrap();
    let s = p.stats();
    assert_eq!(
        (
            s.allocated_bytes.current,
            s.allocated_bytes.peak,
            s.allocated_bytes.allocated,
            s.allocated_bytes.freed
        ),
        (
            6 * MIB as u64,
            8 * MIB as u64,
            9 * MIB as u64,
            3 * MIB as u64
        )
    );
    assert_eq!(s.active_bytes, s.allocated_bytes);
    assert_eq!(s.requested_bytes.current, (6 * MIB - 100) as u64);
    assert_eq!(s.requested_bytes.peak, (8 * MIB - 100) as u64);
    // One 20 MiB segment (large pool) and one 2 MiB (small pool).
    assert_eq!(s.reserved_bytes.current, 22 * MIB as u64);
    assert_eq!(s.reserved_bytes.peak, 22 * MIB as u64);
    assert_eq!((s.segment.current, s.segment.peak), (2, 2));
    assert_eq!((s.num_allocs, s.num_frees), (3, 1));
    assert_eq!(s.free_cached_bytes, 16 * MIB as u64);
    p.free(b);
    p.free(c);
    let s = p.stats();
    assert_eq!(s.allocated_bytes.current, 0);
    assert_eq!(s.allocated_bytes.peak, 8 * MIB as u64);
    assert_eq!(s.requested_bytes.current, 0);
    assert_eq!(s.allocated_bytes.allocated, s.allocated_bytes.freed);
    assert_eq!(s.free_cached_bytes, 22 * MIB as u64);
    p.empty_cache();
    let s = p.stats();
    assert_eq!(s.reserved_bytes.current, 0);
    assert_eq!(s.reserved_bytes.peak, 22 * MIB as u64);
    assert_eq!(s.reserved_bytes.freed, 22 * MIB as u64);
    assert_eq!((s.segment.current, s.segment.peak), (0, 2));
    assert_eq!((s.num_device_alloc, s.num_device_free), (2, 2));
}

#[test]
fn empty_cache_releases_only_fully_free_segments() {
    let mut p = pool(1 << 30);
    let keep = p.alloc(100 * KIB, 0).unwrap(); // small segment, stays partly used
    let gone = p.alloc(100 * KIB, 0).unwrap();
    let own = p.alloc(12 * MIB, 0).unwrap(); // 12 MiB segment, will be fully free
    let large = p.alloc(4 * MIB, 0).unwrap(); // 20 MiB segment, will be fully free
    p.free(gone);
    p.free(large);
    p.free(own);
    assert_eq!(p.allocator().live_segments(), 3);

    p.empty_cache();
    assert_eq!(p.allocator().live_segments(), 1);
    assert_eq!(p.allocator().frees, 2);
    assert_eq!(p.allocator().syncs, 1, "synchronizes before releasing");
    let s = p.stats();
    assert_eq!(s.reserved_bytes.current, 2 * MIB as u64);
    assert_eq!(s.num_device_free, 2);
    assert_eq!(s.inactive_split_bytes, (2 * MIB - 100 * KIB) as u64);

    // Nothing more to release: no call to the allocator at all.
    p.empty_cache();
    assert_eq!((p.allocator().frees, p.allocator().syncs), (2, 1));

    // The live block is untouched; once freed, its segment can go too.
    p.free(keep);
    p.empty_cache();
    assert_eq!(p.allocator().live_segments(), 0);
    assert_eq!(p.allocator().in_use, 0);
    assert_eq!(p.stats().reserved_bytes.current, 0);
    assert_eq!(p.stats().free_cached_bytes, 0);
}

/// 64 MiB device filled with three 20 MiB segments and one 2 MiB segment (62 MiB).
fn filled() -> (Pool<FakeAllocator>, Vec<Block>) {
    let mut p = pool(64 * MIB);
    let blocks = vec![
        p.alloc(20 * MIB, 0).unwrap(),
        p.alloc(20 * MIB, 0).unwrap(),
        p.alloc(20 * MIB, 0).unwrap(),
        p.alloc(KIB, 0).unwrap(),
    ];
    assert_eq!(p.allocator().in_use, 62 * MIB);
    (p, blocks)
}

#[test]
fn out_of_memory_releases_the_cache_and_retries() {
    let (mut p, mut blocks) = filled();
    p.free(blocks.remove(0));
    p.free(blocks.remove(0));
    // 30 MiB does not fit in the 2 MiB left, nor in a cached 20 MiB block; it fits once the
    // two free 20 MiB segments are released.
    let b = p.alloc(30 * MIB, 0).unwrap();
    assert_eq!(b.size, 30 * MIB);
    let s = p.stats();
    assert_eq!(s.num_alloc_retries, 1);
    assert_eq!(s.num_ooms, 0);
    assert_eq!(s.num_device_free, 2);
    assert_eq!(s.reserved_bytes.current, 52 * MIB as u64);
    assert_eq!(p.allocator().syncs, 1);
    assert_eq!(p.allocator().failed_allocs, 1);
    assert_eq!(p.allocator().in_use, 52 * MIB);
}

#[test]
fn a_request_beyond_the_capacity_fails_cleanly() {
    let (mut p, mut blocks) = filled();
    p.free(blocks.remove(0));
    let err = p.alloc(100 * MIB, 0).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("fake:0"), "{msg}");
    assert!(msg.contains("104857600 bytes"), "{msg}");
    assert!(msg.contains("100.00 MiB"), "{msg}");
    assert!(
        msg.contains("reserved") && msg.contains("allocated"),
        "{msg}"
    );
    match &err {
        PoolError::OutOfMemory {
            requested, stats, ..
        } => {
            assert_eq!(*requested, 100 * MIB);
            // The free 20 MiB segment was released before giving up.
            assert_eq!(stats.reserved_bytes.current, 42 * MIB as u64);
            assert_eq!(stats.allocated_bytes.current, (40 * MIB + 512 * 2) as u64);
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    let s = p.stats();
    assert_eq!((s.num_ooms, s.num_alloc_retries), (1, 1));

    // The pool still works: old blocks free and merge, new ones are served.
    let small = p.alloc(300 * KIB, 0).unwrap();
    let big = p.alloc(20 * MIB, 0).unwrap();
    assert_eq!(p.allocator().in_use, 62 * MIB);
    for b in blocks {
        p.free(b);
    }
    p.free(small);
    p.free(big);
    let s = p.stats();
    assert_eq!(s.allocated_bytes.current, 0);
    assert_eq!(s.requested_bytes.current, 0);
    assert_eq!(s.inactive_split_bytes, 0);
    p.empty_cache();
    assert_eq!(p.allocator().in_use, 0);
    assert_eq!(p.alloc(60 * MIB, 0).unwrap().size, 60 * MIB);
    assert_eq!(p.stats().num_ooms, 1);
}

#[test]
fn other_allocator_errors_are_reported_without_retry() {
    let mut p = pool(1 << 30);
    p.allocator_mut().fail_next = Some("launch timed out".into());
    let err = p.alloc(MIB, 0).unwrap_err();
    assert!(matches!(err, PoolError::Other(_)), "{err:?}");
    assert!(err.to_string().contains("launch timed out"), "{err}");
    let s = p.stats();
    assert_eq!((s.num_alloc_retries, s.num_ooms), (0, 0));
    assert!(p.alloc(MIB, 0).is_ok());
}

#[test]
fn fragmentation_of_a_constructed_layout() {
    let mut p = pool(1 << 30);
    // One 2 MiB segment: four 512 KiB blocks.
    let mut q: Vec<Block> = (0..4).map(|_| p.alloc(512 * KIB, 0).unwrap()).collect();
    assert_eq!(p.stats().fragmentation, 0.0, "nothing free");
    let d = q.pop().unwrap();
    let c = q.pop().unwrap();
    let b = q.pop().unwrap();
    let a = q.pop().unwrap();
    // Free a and c: two separate 512 KiB holes.
    p.free(a);
    p.free(c);
    let s = p.stats();
    assert_eq!(s.free_cached_bytes, MIB as u64);
    assert_eq!(s.largest_free_block, 512 * KIB as u64);
    assert_eq!(s.fragmentation, 0.5);
    assert_eq!((s.inactive_split, s.inactive_split_bytes), (2, MIB as u64));
    // A fully free 12 MiB segment: free 13 MiB, largest 12 MiB.
    let big = p.alloc(12 * MIB, 0).unwrap();
    p.free(big);
    let s = p.stats();
    assert_eq!(s.free_cached_bytes, 13 * MIB as u64);
    assert_eq!(s.largest_free_block, 12 * MIB as u64);
    assert!(
        (s.fragmentation - 1.0 / 13.0).abs() < 1e-12,
        "{}",
        s.fragmentation
    );
    assert_eq!(
        s.inactive_split_bytes, MIB as u64,
        "a whole free segment is releasable"
    );
    // Freeing b joins a, b and c into one 1.5 MiB hole.
    p.free(b);
    p.empty_cache();
    let s = p.stats();
    assert_eq!(s.free_cached_bytes, (MIB + 512 * KIB) as u64);
    assert_eq!(s.fragmentation, 0.0);
    p.free(d);
}

#[test]
fn stats_display_is_a_table_in_mib() {
    let mut p = pool(1 << 30);
    let _a = p.alloc(3 * MIB, 0).unwrap();
    let text = p.stats().to_string();
    assert!(text.lines().count() >= 6, "{text}");
    let row = text.lines().find(|l| l.starts_with("reserved")).unwrap();
    assert!(row.contains("20.00"), "{text}");
    let row = text.lines().find(|l| l.starts_with("allocated")).unwrap();
    assert!(row.contains("3.00"), "{text}");
    assert!(text.contains("fragmentation"), "{text}");
}

/// Random allocations and frees on two streams keep the pool consistent with the device.
#[test]
fn random_workload_keeps_invariants() {
    let mut p = pool(256 * MIB);
    let mut live: Vec<Block> = Vec::new();
    let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for step in 0..4000 {
        let r = next();
        if live.is_empty() || r % 3 != 0 {
            let bytes = match r % 4 {
                0 => (next() % 4096) as usize,
                1 => (next() % MIB as u64) as usize,
                2 => (next() % (12 * MIB as u64)) as usize,
                _ => (next() % (40 * MIB as u64)) as usize,
            };
            match p.alloc(bytes, next() % 2) {
                Ok(b) => {
                    assert!(b.size >= bytes && b.size % 512 == 0, "step {step}");
                    live.push(b)
                }
                Err(PoolError::OutOfMemory { .. }) => {}
                Err(e) => panic!("step {step}: {e}"),
            }
        } else {
            let i = (next() % live.len() as u64) as usize;
            p.free(live.swap_remove(i));
        }
        if step % 500 == 499 {
            p.empty_cache();
        }
        let s = p.stats();
        let sum: u64 = live.iter().map(|b| b.size as u64).sum();
        assert_eq!(s.allocated_bytes.current, sum, "step {step}");
        assert_eq!(s.reserved_bytes.current, p.allocator().in_use as u64);
        assert_eq!(
            s.free_cached_bytes + s.allocated_bytes.current,
            s.reserved_bytes.current,
            "step {step}"
        );
        assert!(s.inactive_split_bytes <= s.free_cached_bytes);
        assert!((0.0..1.0).contains(&s.fragmentation));
    }
    // Live blocks never overlap.
    let mut spans: Vec<(u64, u64)> = live
        .iter()
        .filter(|b| b.size > 0)
        .map(|b| (b.addr, b.addr + b.size as u64))
        .collect();
    spans.sort_unstable();
    for w in spans.windows(2) {
        assert!(w[0].1 <= w[1].0, "overlap: {w:?}");
    }
    for b in live {
        p.free(b);
    }
    p.empty_cache();
    assert_eq!(p.allocator().in_use, 0);
    assert_eq!(p.stats().free_cached_bytes, 0);
}

#[test]
fn peaks_start_over_from_the_current_values() {
    let mut p = pool(1 << 30);
    let big = p.alloc(8 * MIB, 0).unwrap();
    let small = p.alloc(4 * KIB, 0).unwrap();
    p.free(big);
    let before = p.stats();
    assert_eq!(before.allocated_bytes.peak, (8 * MIB + 4 * KIB) as u64);
    p.reset_peak_stats();
    let s = p.stats();
    assert_eq!(s.allocated_bytes.peak, s.allocated_bytes.current);
    assert_eq!(s.allocated_bytes.current, (4 * KIB) as u64);
    assert_eq!(s.requested_bytes.peak, (4 * KIB) as u64);
    assert_eq!(s.reserved_bytes.peak, s.reserved_bytes.current);
    assert_eq!(s.segment.peak, s.segment.current);
    // Totals are not peaks: they keep counting.
    assert_eq!(
        s.allocated_bytes.allocated,
        before.allocated_bytes.allocated
    );
    assert_eq!(s.num_allocs, before.num_allocs);
    // A later allocation sets the new peak, below the old one.
    let mid = p.alloc(2 * MIB, 0).unwrap();
    assert_eq!(p.stats().allocated_bytes.peak, (2 * MIB + 4 * KIB) as u64);
    p.free(mid);
    p.free(small);
    assert_eq!(p.stats().allocated_bytes.peak, (2 * MIB + 4 * KIB) as u64);
}
