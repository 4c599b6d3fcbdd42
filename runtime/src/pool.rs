//! The caching device memory pool.
//!
//! Device memory is obtained in large *segments* from a [`SegmentAllocator`] (the CUDA driver on
//! a GPU, [`FakeAllocator`] in tests) and handed out as *blocks* carved from those segments. Freed
//! blocks stay cached in the pool and are reused by later requests; segments go back to the
//! allocator only through [`Pool::empty_cache`] or when an allocation would otherwise fail. The
//! rules follow PyTorch's `CUDACachingAllocator` (with its default settings):
//!
//! # Sizes
//!
//! - **Rounding.** Every request is rounded up to a multiple of 512 B (at least 512 B). A zero-byte
//!   request returns an empty [`Block`] (size 0, address 0) that holds no memory and is not counted
//!   in any statistic.
//! - **Pools.** Rounded sizes ≤ 1 MiB come from the *small pool*, larger ones from the *large
//!   pool*. A block never moves between pools.
//! - **Segment sizes.** A small request that finds no free block allocates a 2 MiB segment; a
//!   request in (1 MiB, 10 MiB) allocates a 20 MiB segment; a request ≥ 10 MiB allocates a segment
//!   of its size rounded up to 2 MiB.
//!
//! # Reuse
//!
//! - **Best fit.** A request takes the smallest free block of the same pool *and the same stream*
//!   that is large enough (ties: the lowest address). A freed block is reused only on the stream it
//!   was allocated on. Work on one stream runs in order, so that reuse needs no events.
//! - **Splitting.** When the chosen block is larger than needed, the rest becomes a new free
//!   block if it is ≥ 512 B (small pool) or > 1 MiB (large pool). Otherwise the request gets the
//!   whole block, so [`Block::size`] can exceed the rounded request.
//! - **Merging.** A freed block merges with the free blocks right before and after it in the same
//!   segment, so a segment never holds two adjacent free blocks.
//!
//! # Out of memory
//!
//! When the allocator cannot provide a segment, the pool calls
//! [`SegmentAllocator::synchronize`], releases every cached segment that is entirely free and
//! tries once more (counted in [`MemoryStats::num_alloc_retries`]). If that fails too, the request
//! fails with [`PoolError::OutOfMemory`], which names the requested size and the pool's state
//! (counted in [`MemoryStats::num_ooms`]). The pool remains fully usable afterwards.
//!
//! # Statistics
//!
//! [`MemoryStats`] follows `torch.cuda.memory_stats()` (over both pools together). A [`Stat`]
//! holds four numbers: `current`, `peak` (the largest `current` so far), `allocated` (the sum of
//! all increases) and `freed` (the sum of all decreases).
//!
//! - `allocated_bytes`: the sizes of the blocks handed out and not yet freed (as rounded and
//!   possibly enlarged by a declined split, i.e. the sum of [`Block::size`]).
//! - `requested_bytes`: the same blocks counted at the sizes originally requested.
//! - `active_bytes`: allocated blocks plus freed blocks still waiting on other streams' work. This
//!   pool never defers a free, so it equals `allocated_bytes`; it is kept for comparison with torch.
//! - `reserved_bytes`: the bytes of all segments obtained from the allocator.
//! - `segment`: the number of segments (its `allocated`/`freed` equal `num_device_alloc` /
//!   `num_device_free`).
//! - `num_allocs`, `num_frees`: successful non-empty [`Pool::alloc`] and [`Pool::free`] calls.
//! - `num_device_alloc`, `num_device_free`: segment allocations and releases.
//! - `num_alloc_retries`: allocations retried after releasing the cache; `num_ooms`: requests that
//!   failed with out-of-memory.
//! - `free_cached_bytes`: the bytes of all free blocks (= reserved − active).
//! - `largest_free_block`: the size of the largest free block.
//! - `inactive_split`, `inactive_split_bytes`: the number and bytes of free blocks inside segments
//!   that also hold live blocks. [`Pool::empty_cache`] cannot release them.
//! - `fragmentation` = 1 − `largest_free_block` / `free_cached_bytes` (0 when nothing is free):
//!   the share of the cached free memory that one request as large as all of it could not use.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

/// Every block size is a multiple of this (bytes).
pub const MIN_BLOCK_SIZE: usize = 512;
/// The largest rounded size served by the small pool (bytes).
pub const SMALL_SIZE: usize = 1 << 20;
/// The segment size of the small pool (bytes).
pub const SMALL_SEGMENT: usize = 2 << 20;
/// Requests from this size (bytes) get a segment of their own size rounded to [`ROUND_LARGE`].
pub const MIN_LARGE_ALLOC: usize = 10 << 20;
/// The segment size for requests in (1 MiB, 10 MiB) (bytes).
pub const LARGE_SEGMENT: usize = 20 << 20;
/// Segments of large requests are rounded up to a multiple of this (bytes).
pub const ROUND_LARGE: usize = 2 << 20;

const MIB: f64 = (1u64 << 20) as f64;

/// An error of a [`SegmentAllocator`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SegmentError {
    /// The device has no room for the segment.
    #[error("out of device memory")]
    OutOfMemory,
    /// Any other failure, with the driver's message.
    #[error("{0}")]
    Other(String),
}

/// An error of [`Pool::alloc`].
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// No memory was left even after releasing the cache and retrying.
    #[error("{}", oom_message(device, *requested, stats))]
    OutOfMemory {
        /// The device's name.
        device: String,
        /// The requested size in bytes (before rounding).
        requested: usize,
        /// The pool's statistics when the request failed.
        stats: Box<MemoryStats>,
    },
    /// The allocator failed for another reason.
    #[error("{0}")]
    Other(String),
}

fn oom_message(device: &str, requested: usize, s: &MemoryStats) -> String {
    format!(
        "out of memory on {device}: tried to allocate {requested} bytes ({:.2} MiB); the pool has \
         {:.2} MiB reserved, {:.2} MiB allocated, {:.2} MiB free in its cache (largest free block \
         {:.2} MiB) after releasing every free segment",
        requested as f64 / MIB,
        s.reserved_bytes.current as f64 / MIB,
        s.allocated_bytes.current as f64 / MIB,
        s.free_cached_bytes as f64 / MIB,
        s.largest_free_block as f64 / MIB,
    )
}

/// Where segments come from: the CUDA driver on a GPU, a fake in tests.
pub trait SegmentAllocator: Send {
    /// Allocates a segment of exactly `bytes` and returns its device address;
    /// `Err(SegmentError::OutOfMemory)` when the device is full.
    fn alloc(&mut self, bytes: usize) -> Result<u64, SegmentError>;
    /// Frees a whole segment returned by [`SegmentAllocator::alloc`].
    fn free(&mut self, addr: u64, bytes: usize);
    /// Waits for all device work that may still use freed memory (called before segments are
    /// released).
    fn synchronize(&mut self);
}

impl<A: SegmentAllocator + ?Sized> SegmentAllocator for Box<A> {
    fn alloc(&mut self, bytes: usize) -> Result<u64, SegmentError> {
        (**self).alloc(bytes)
    }
    fn free(&mut self, addr: u64, bytes: usize) {
        (**self).free(addr, bytes)
    }
    fn synchronize(&mut self) {
        (**self).synchronize()
    }
}

/// One statistic in the shape of torch's: current value, peak and running totals.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    /// The value now.
    pub current: u64,
    /// The largest `current` so far.
    pub peak: u64,
    /// The sum of all increases.
    pub allocated: u64,
    /// The sum of all decreases.
    pub freed: u64,
}

impl Stat {
    fn increase(&mut self, n: u64) {
        self.current += n;
        self.allocated += n;
        self.peak = self.peak.max(self.current);
    }

    fn decrease(&mut self, n: u64) {
        debug_assert!(self.current >= n, "statistic would go negative");
        self.current -= n;
        self.freed += n;
    }
}

/// Statistics of a memory pool, in the shape of `torch.cuda.memory_stats()`; the module
/// documentation defines each one.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MemoryStats {
    /// Bytes of live blocks (sum of [`Block::size`]).
    pub allocated_bytes: Stat,
    /// Bytes of live blocks at their requested sizes.
    pub requested_bytes: Stat,
    /// Bytes of live blocks plus frees pending on other streams (here equal to `allocated_bytes`).
    pub active_bytes: Stat,
    /// Bytes of all segments obtained from the allocator.
    pub reserved_bytes: Stat,
    /// Number of segments.
    pub segment: Stat,
    /// Successful non-empty allocations.
    pub num_allocs: u64,
    /// Frees of non-empty blocks.
    pub num_frees: u64,
    /// Allocations retried after releasing the cache.
    pub num_alloc_retries: u64,
    /// Requests that failed with out-of-memory.
    pub num_ooms: u64,
    /// Segments obtained from the allocator.
    pub num_device_alloc: u64,
    /// Segments given back to the allocator.
    pub num_device_free: u64,
    /// Free blocks inside segments that also hold live blocks.
    pub inactive_split: u64,
    /// Bytes of those blocks (free but not releasable by `empty_cache`).
    pub inactive_split_bytes: u64,
    /// Size of the largest free block (bytes).
    pub largest_free_block: u64,
    /// Bytes of all free blocks in the cache.
    pub free_cached_bytes: u64,
    /// 1 − `largest_free_block` / `free_cached_bytes` (0 when nothing is free).
    pub fragmentation: f64,
}

impl fmt::Display for MemoryStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: u64| b as f64 / MIB;
        writeln!(
            f,
            "{:<16}{:>12}{:>12}{:>12}{:>12}",
            "memory (MiB)", "current", "peak", "allocated", "freed"
        )?;
        for (name, s) in [
            ("allocated", &self.allocated_bytes),
            ("requested", &self.requested_bytes),
            ("active", &self.active_bytes),
            ("reserved", &self.reserved_bytes),
        ] {
            writeln!(
                f,
                "{name:<16}{:>12.2}{:>12.2}{:>12.2}{:>12.2}",
                mib(s.current),
                mib(s.peak),
                mib(s.allocated),
                mib(s.freed)
            )?;
        }
        let s = &self.segment;
        writeln!(
            f,
            "{:<16}{:>12}{:>12}{:>12}{:>12}",
            "segments (n)", s.current, s.peak, s.allocated, s.freed
        )?;
        writeln!(
            f,
            "free cached {:.2} MiB, largest free block {:.2} MiB, inactive split {:.2} MiB \
             ({} blocks), fragmentation {:.3}",
            mib(self.free_cached_bytes),
            mib(self.largest_free_block),
            mib(self.inactive_split_bytes),
            self.inactive_split,
            self.fragmentation
        )?;
        write!(
            f,
            "allocs {}, frees {}, device allocs {}, device frees {}, retries {}, OOMs {}",
            self.num_allocs,
            self.num_frees,
            self.num_device_alloc,
            self.num_device_free,
            self.num_alloc_retries,
            self.num_ooms
        )
    }
}

/// Memory handed out by [`Pool::alloc`]; give it back with [`Pool::free`] of the same pool.
#[derive(Debug)]
pub struct Block {
    /// Device address (0 for an empty block).
    pub addr: u64,
    /// Size in bytes: the request rounded up to 512 B, or more when splitting was not worth it.
    pub size: usize,
    /// The size that was requested.
    pub requested: usize,
    /// The segment it lies in (None for an empty block).
    segment: Option<u64>,
    /// The stream it was allocated for.
    stream: u64,
}

impl Block {
    /// The stream the block was allocated for; it is reused only there after it is freed.
    pub fn stream(&self) -> u64 {
        self.stream
    }
}

/// Which pool a size belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Kind {
    Small,
    Large,
}

impl Kind {
    fn of(rounded: usize) -> Kind {
        if rounded <= SMALL_SIZE {
            Kind::Small
        } else {
            Kind::Large
        }
    }

    /// Whether a free block with `remaining` bytes beyond the request is split.
    fn should_split(self, remaining: usize) -> bool {
        match self {
            Kind::Small => remaining >= MIN_BLOCK_SIZE,
            Kind::Large => remaining > SMALL_SIZE,
        }
    }
}

/// The request rounded up to a multiple of [`MIN_BLOCK_SIZE`] (None on overflow).
fn round_size(bytes: usize) -> Option<usize> {
    Some(bytes.checked_add(MIN_BLOCK_SIZE - 1)? / MIN_BLOCK_SIZE * MIN_BLOCK_SIZE)
}

/// The segment size allocated for a rounded request that found no free block.
fn segment_size(rounded: usize) -> Option<usize> {
    if rounded <= SMALL_SIZE {
        Some(SMALL_SEGMENT)
    } else if rounded < MIN_LARGE_ALLOC {
        Some(LARGE_SEGMENT)
    } else {
        Some(rounded.checked_add(ROUND_LARGE - 1)? / ROUND_LARGE * ROUND_LARGE)
    }
}

/// A contiguous piece of a segment.
#[derive(Clone, Copy, Debug)]
struct Chunk {
    size: usize,
    allocated: bool,
}

/// Memory obtained from the allocator in one call, tiled by chunks.
#[derive(Debug)]
struct Segment {
    addr: u64,
    size: usize,
    kind: Kind,
    stream: u64,
    /// Chunks by address; they cover the segment without gaps.
    chunks: BTreeMap<u64, Chunk>,
}

impl Segment {
    fn is_fully_free(&self) -> bool {
        self.chunks.len() == 1 && self.chunks.values().all(|c| !c.allocated)
    }
}

/// The key of a free chunk in the best-fit index: ordered so that a range query from
/// `(kind, stream, size, 0)` yields the smallest fitting chunk, lowest address first.
type FreeKey = (Kind, u64, usize, u64);

/// A caching pool of device memory over a [`SegmentAllocator`] (see the module documentation).
#[derive(Debug)]
pub struct Pool<A: SegmentAllocator> {
    allocator: A,
    device: String,
    segments: HashMap<u64, Segment>,
    next_segment: u64,
    /// Every free chunk, mapped to its segment.
    free: BTreeMap<FreeKey, u64>,
    stats: MemoryStats,
}

impl<A: SegmentAllocator> Pool<A> {
    /// An empty pool over `allocator`; `device_name` appears in error messages.
    pub fn new(allocator: A, device_name: String) -> Self {
        Pool {
            allocator,
            device: device_name,
            segments: HashMap::new(),
            next_segment: 0,
            free: BTreeMap::new(),
            stats: MemoryStats::default(),
        }
    }

    /// The device's name.
    pub fn device_name(&self) -> &str {
        &self.device
    }

    /// The segment allocator.
    pub fn allocator(&self) -> &A {
        &self.allocator
    }

    /// The segment allocator, mutably.
    pub fn allocator_mut(&mut self) -> &mut A {
        &mut self.allocator
    }

    /// Allocates `bytes` (rounded as the module documentation says) for use on stream `stream`
    /// (an opaque id). Reuses a cached block of the same stream when one fits; otherwise
    /// allocates a segment, releasing the cache and retrying once when the device is full.
    pub fn alloc(&mut self, bytes: usize, stream: u64) -> Result<Block, PoolError> {
        if bytes == 0 {
            return Ok(Block {
                addr: 0,
                size: 0,
                requested: 0,
                segment: None,
                stream,
            });
        }
        let Some(size) = round_size(bytes) else {
            return Err(self.out_of_memory(bytes));
        };
        let kind = Kind::of(size);
        let (seg_id, addr, chunk_size) = match self.take_free(kind, stream, size) {
            Some(found) => found,
            None => self.new_segment(kind, stream, size, bytes)?,
        };
        let segment = self
            .segments
            .get_mut(&seg_id)
            .expect("segment of a free chunk");
        let remaining = chunk_size - size;
        let size = if kind.should_split(remaining) {
            let rest = addr + size as u64;
            segment.chunks.insert(
                rest,
                Chunk {
                    size: remaining,
                    allocated: false,
                },
            );
            self.free.insert((kind, stream, remaining, rest), seg_id);
            size
        } else {
            chunk_size
        };
        segment.chunks.insert(
            addr,
            Chunk {
                size,
                allocated: true,
            },
        );
        self.stats.allocated_bytes.increase(size as u64);
        self.stats.active_bytes.increase(size as u64);
        self.stats.requested_bytes.increase(bytes as u64);
        self.stats.num_allocs += 1;
        Ok(Block {
            addr,
            size,
            requested: bytes,
            segment: Some(seg_id),
            stream,
        })
    }

    /// Returns `block` to the cache, merging it with free neighbours in its segment. The memory
    /// stays reserved; it is reused by requests on the block's stream.
    ///
    /// # Panics
    /// If `block` was not handed out by this pool (or was already freed).
    pub fn free(&mut self, block: Block) {
        let Some(seg_id) = block.segment else {
            return;
        };
        let segment = self
            .segments
            .get_mut(&seg_id)
            .expect("freed block does not belong to this pool");
        let chunk = segment.chunks.get(&block.addr).copied();
        assert!(
            matches!(chunk, Some(c) if c.allocated && c.size == block.size),
            "freed block at {:#x} does not belong to this pool",
            block.addr
        );
        let (kind, stream) = (segment.kind, segment.stream);
        let mut addr = block.addr;
        let mut size = block.size;
        // Merge with the free chunk right before.
        if let Some((&prev, &c)) = segment.chunks.range(..addr).next_back() {
            if !c.allocated {
                debug_assert_eq!(prev + c.size as u64, addr, "chunks must tile the segment");
                self.free.remove(&(kind, stream, c.size, prev));
                segment.chunks.remove(&addr);
                addr = prev;
                size += c.size;
            }
        }
        // Merge with the free chunk right after.
        let next = addr + size as u64;
        if let Some(&c) = segment.chunks.get(&next) {
            if !c.allocated {
                self.free.remove(&(kind, stream, c.size, next));
                segment.chunks.remove(&next);
                size += c.size;
            }
        }
        segment.chunks.insert(
            addr,
            Chunk {
                size,
                allocated: false,
            },
        );
        self.free.insert((kind, stream, size, addr), seg_id);
        self.stats.allocated_bytes.decrease(block.size as u64);
        self.stats.active_bytes.decrease(block.size as u64);
        self.stats.requested_bytes.decrease(block.requested as u64);
        self.stats.num_frees += 1;
    }

    /// Releases every cached segment that is entirely free to the allocator (like
    /// `torch.cuda.empty_cache()`), after [`SegmentAllocator::synchronize`]. Segments that still
    /// hold a live block stay.
    pub fn empty_cache(&mut self) {
        self.release_free_segments(false);
    }

    /// Starts the peaks of the byte and segment statistics over from their current values (like
    /// `torch.cuda.reset_peak_memory_stats()`), so that a later [`Pool::stats`] reports the
    /// high-water mark of what ran since, such as one model's forward.
    pub fn reset_peak_stats(&mut self) {
        let s = &mut self.stats;
        for stat in [
            &mut s.allocated_bytes,
            &mut s.requested_bytes,
            &mut s.active_bytes,
            &mut s.reserved_bytes,
            &mut s.segment,
        ] {
            stat.peak = stat.current;
        }
    }

    /// The pool's statistics now.
    pub fn stats(&self) -> MemoryStats {
        let mut s = self.stats.clone();
        for (&(_, _, size, _), seg_id) in &self.free {
            let size = size as u64;
            s.free_cached_bytes += size;
            s.largest_free_block = s.largest_free_block.max(size);
            if self.segments[seg_id].chunks.len() > 1 {
                s.inactive_split += 1;
                s.inactive_split_bytes += size;
            }
        }
        s.fragmentation = if s.free_cached_bytes == 0 {
            0.0
        } else {
            1.0 - s.largest_free_block as f64 / s.free_cached_bytes as f64
        };
        s
    }

    /// Removes the best-fitting free chunk of `kind` on `stream` with at least `size` bytes from
    /// the index: (segment, address, chunk size).
    fn take_free(&mut self, kind: Kind, stream: u64, size: usize) -> Option<(u64, u64, usize)> {
        let (&key, &seg_id) = self.free.range((kind, stream, size, 0)..).next()?;
        let (k, s, chunk_size, addr) = key;
        if k != kind || s != stream {
            return None;
        }
        self.free.remove(&key);
        Some((seg_id, addr, chunk_size))
    }

    /// Allocates a segment for a rounded request of `size` bytes (`requested` for messages),
    /// releasing the cache and retrying once when the device is full. Returns the segment's
    /// single chunk, not entered in the free index: (segment, address, segment size).
    fn new_segment(
        &mut self,
        kind: Kind,
        stream: u64,
        size: usize,
        requested: usize,
    ) -> Result<(u64, u64, usize), PoolError> {
        let Some(seg_size) = segment_size(size) else {
            return Err(self.out_of_memory(requested));
        };
        let addr = match self.allocator.alloc(seg_size) {
            Ok(addr) => addr,
            Err(SegmentError::OutOfMemory) => {
                self.allocator.synchronize();
                self.release_free_segments(true);
                self.stats.num_alloc_retries += 1;
                match self.allocator.alloc(seg_size) {
                    Ok(addr) => addr,
                    Err(SegmentError::OutOfMemory) => return Err(self.out_of_memory(requested)),
                    Err(SegmentError::Other(msg)) => return Err(self.other(msg)),
                }
            }
            Err(SegmentError::Other(msg)) => return Err(self.other(msg)),
        };
        let id = self.next_segment;
        self.next_segment += 1;
        let chunks = BTreeMap::from([(
            addr,
            Chunk {
                size: seg_size,
                allocated: false,
            },
        )]);
        self.segments.insert(
            id,
            Segment {
                addr,
                size: seg_size,
                kind,
                stream,
                chunks,
            },
        );
        self.stats.reserved_bytes.increase(seg_size as u64);
        self.stats.segment.increase(1);
        self.stats.num_device_alloc += 1;
        Ok((id, addr, seg_size))
    }

    /// Frees every entirely free segment, synchronizing first unless `synced`.
    fn release_free_segments(&mut self, synced: bool) {
        let mut ids: Vec<u64> = self
            .segments
            .iter()
            .filter(|(_, s)| s.is_fully_free())
            .map(|(&id, _)| id)
            .collect();
        if ids.is_empty() {
            return;
        }
        ids.sort_unstable();
        if !synced {
            self.allocator.synchronize();
        }
        for id in ids {
            let seg = self.segments.remove(&id).expect("listed segment");
            self.free
                .remove(&(seg.kind, seg.stream, seg.size, seg.addr));
            self.allocator.free(seg.addr, seg.size);
            self.stats.reserved_bytes.decrease(seg.size as u64);
            self.stats.segment.decrease(1);
            self.stats.num_device_free += 1;
        }
    }

    fn out_of_memory(&mut self, requested: usize) -> PoolError {
        self.stats.num_ooms += 1;
        PoolError::OutOfMemory {
            device: self.device.clone(),
            requested,
            stats: Box::new(self.stats()),
        }
    }

    fn other(&self, msg: String) -> PoolError {
        PoolError::Other(format!(
            "allocating device memory on {}: {msg}",
            self.device
        ))
    }
}

/// A [`SegmentAllocator`] for tests: hands out increasing fake addresses (never reused, with a
/// gap between segments), fails with [`SegmentError::OutOfMemory`] beyond `capacity` bytes in use
/// and counts its calls.
#[derive(Clone, Debug)]
pub struct FakeAllocator {
    /// The most bytes that may be in use at once.
    pub capacity: usize,
    /// Bytes in use now.
    pub in_use: usize,
    /// Successful `alloc` calls.
    pub allocs: u64,
    /// `alloc` calls that failed.
    pub failed_allocs: u64,
    /// `free` calls.
    pub frees: u64,
    /// `synchronize` calls.
    pub syncs: u64,
    /// When set, the next `alloc` fails with `SegmentError::Other` and this message.
    pub fail_next: Option<String>,
    next_addr: u64,
    live: HashMap<u64, usize>,
}

impl FakeAllocator {
    /// The first address handed out.
    pub const BASE: u64 = 0x7f00_0000_0000;

    /// A fake device with `capacity` bytes.
    pub fn new(capacity: usize) -> Self {
        FakeAllocator {
            capacity,
            in_use: 0,
            allocs: 0,
            failed_allocs: 0,
            frees: 0,
            syncs: 0,
            fail_next: None,
            next_addr: Self::BASE,
            live: HashMap::new(),
        }
    }

    /// The number of segments allocated and not freed.
    pub fn live_segments(&self) -> usize {
        self.live.len()
    }
}

impl SegmentAllocator for FakeAllocator {
    fn alloc(&mut self, bytes: usize) -> Result<u64, SegmentError> {
        if let Some(msg) = self.fail_next.take() {
            self.failed_allocs += 1;
            return Err(SegmentError::Other(msg));
        }
        let fits = matches!(self.in_use.checked_add(bytes), Some(n) if n <= self.capacity);
        if !fits {
            self.failed_allocs += 1;
            return Err(SegmentError::OutOfMemory);
        }
        let addr = self.next_addr;
        // Leave a gap so that neighbouring segments are never contiguous.
        self.next_addr += bytes as u64 + (1 << 20);
        self.in_use += bytes;
        self.allocs += 1;
        self.live.insert(addr, bytes);
        Ok(addr)
    }

    fn free(&mut self, addr: u64, bytes: usize) {
        let size = self.live.remove(&addr);
        assert_eq!(
            size,
            Some(bytes),
            "free of {addr:#x} ({bytes} bytes): not a live segment of that size"
        );
        self.in_use -= bytes;
        self.frees += 1;
    }

    fn synchronize(&mut self) {
        self.syncs += 1;
    }
}
