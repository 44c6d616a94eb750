//! Blocks freed in stream order (`cudaFreeAsync` on the stream they were allocated on), kept
//! aside per stream for the next allocation of the same size on that stream.
//!
//! Stream order makes such a block reusable on its stream at once, which is all the caching
//! allocator would do with it too; keeping a few of them here lets the commonest pattern (free
//! a buffer, allocate one of the same size on the same stream) skip the allocator's free lists
//! and statistics both ways. The blocks stay allocated in the allocator's view until they are
//! given back: when a slot is needed for another block or stream, when their stream is
//! destroyed, and when memory runs short. Only small blocks are kept, a few per slot, so what
//! this holds is bounded (`SLOTS * WAYS * MAX_BYTES`) and counted as free memory.

use parking_lot::Mutex;
use tensoralloc::driver::Stream;

/// Largest request kept aside (the caching allocator's small-block limit).
pub const MAX_BYTES: usize = 1 << 20;
const SLOTS: usize = 16;
const WAYS: usize = 4;
/// The stream of a slot that holds nothing (never a stream handle: handles are aligned).
const NO_STREAM: Stream = usize::MAX;

/// A block kept aside: its address and the size it was asked for.
#[derive(Clone, Copy)]
struct Kept {
    ptr: usize,
    size: usize,
}

struct Slot {
    stream: Stream,
    kept: [Kept; WAYS],
    len: usize,
    /// Allocations served from this slot.
    hits: u64,
}

#[repr(align(64))]
struct Padded(Mutex<Slot>);

/// Blocks given back to the caching allocator: address and pool (the stream).
pub type Spilled = ([(usize, Stream); WAYS], usize);

/// One device's blocks kept aside.
pub struct Front {
    slots: [Padded; SLOTS],
}

impl Front {
    pub fn new() -> Self {
        Front {
            slots: std::array::from_fn(|_| {
                Padded(Mutex::new(Slot {
                    stream: NO_STREAM,
                    kept: [Kept { ptr: 0, size: 0 }; WAYS],
                    len: 0,
                    hits: 0,
                }))
            }),
        }
    }

    #[inline]
    fn slot(&self, stream: Stream) -> &Mutex<Slot> {
        let h = (stream as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        &self.slots[(h >> (64 - SLOTS.trailing_zeros())) as usize].0
    }

    /// A block of exactly `size` bytes kept for `stream`, if there is one.
    #[inline]
    pub fn take(&self, stream: Stream, size: usize) -> Option<usize> {
        let mut s = self.slot(stream).lock();
        if s.stream != stream {
            return None;
        }
        let i = s.kept[..s.len].iter().rposition(|k| k.size == size)?;
        let ptr = s.kept[i].ptr;
        s.len -= 1;
        let last = s.len;
        s.kept[i] = s.kept[last];
        s.hits += 1;
        Some(ptr)
    }

    /// Keeps the block at `ptr` (`size` bytes asked for, freed on `stream`, its pool). Returns
    /// the blocks it displaced, for the caller to give back to the allocator.
    #[inline]
    pub fn keep(&self, stream: Stream, size: usize, ptr: usize) -> Spilled {
        let mut spilled: Spilled = ([(0, 0); WAYS], 0);
        let mut s = self.slot(stream).lock();
        if s.stream != stream {
            // Another stream's blocks leave the slot.
            spill_all(&mut s, &mut spilled);
            s.stream = stream;
        }
        if s.len == WAYS {
            // The oldest block leaves.
            spilled.0[0] = (s.kept[0].ptr, stream);
            spilled.1 = 1;
            s.kept.copy_within(1.., 0);
            s.len -= 1;
        }
        let len = s.len;
        s.kept[len] = Kept { ptr, size };
        s.len += 1;
        spilled
    }

    /// Gives back every block kept for `stream` (destroyed: its handle may name another
    /// stream later), or for every stream with `None` (memory is short).
    pub fn drain(&self, stream: Option<Stream>, mut give_back: impl FnMut(usize, Stream)) {
        let slots: Vec<&Mutex<Slot>> = match stream {
            Some(s) => vec![self.slot(s)],
            None => self.slots.iter().map(|p| &p.0).collect(),
        };
        for slot in slots {
            let mut spilled: Spilled = ([(0, 0); WAYS], 0);
            {
                let mut s = slot.lock();
                if stream.is_none_or(|st| s.stream == st) {
                    spill_all(&mut s, &mut spilled);
                }
            }
            for &(ptr, pool) in &spilled.0[..spilled.1] {
                give_back(ptr, pool);
            }
        }
    }

    /// The sizes asked for of the blocks kept now, and the allocations served from here.
    pub fn summary(&self) -> (Vec<usize>, u64) {
        let mut sizes = Vec::new();
        let mut hits = 0;
        for p in &self.slots {
            let s = p.0.lock();
            sizes.extend(s.kept[..s.len].iter().map(|k| k.size));
            hits += s.hits;
        }
        (sizes, hits)
    }
}

fn spill_all(s: &mut Slot, spilled: &mut Spilled) {
    for k in &s.kept[..s.len] {
        spilled.0[spilled.1] = (k.ptr, s.stream);
        spilled.1 += 1;
    }
    s.len = 0;
    s.stream = NO_STREAM;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_block_comes_back_for_its_stream_and_size_only() {
        let f = Front::new();
        assert_eq!(f.keep(0x100, 4096, 0xa000).1, 0);
        assert_eq!(f.take(0x200, 4096), None);
        assert_eq!(f.take(0x100, 8192), None);
        assert_eq!(f.take(0x100, 4096), Some(0xa000));
        assert_eq!(f.take(0x100, 4096), None);
    }

    #[test]
    fn a_full_slot_gives_back_its_oldest_block() {
        let f = Front::new();
        for i in 0..WAYS {
            assert_eq!(f.keep(0x100, 512, 0x1000 * (i + 1)).1, 0);
        }
        let (spilled, n) = f.keep(0x100, 512, 0x9000);
        assert_eq!(&spilled[..n], &[(0x1000, 0x100)]);
    }

    #[test]
    fn another_stream_in_the_same_slot_displaces_every_block_of_the_first() {
        let f = Front::new();
        let first = 0x100;
        let other = (0x200..)
            .step_by(0x100)
            .find(|&s| std::ptr::eq(f.slot(s), f.slot(first)))
            .unwrap();
        f.keep(first, 512, 0x1000);
        f.keep(first, 1024, 0x2000);
        let (spilled, n) = f.keep(other, 512, 0x3000);
        assert_eq!(&spilled[..n], &[(0x1000, first), (0x2000, first)]);
        assert_eq!(f.take(first, 512), None);
        assert_eq!(f.take(other, 512), Some(0x3000));
    }

    #[test]
    fn draining_a_stream_gives_back_its_blocks_and_keeps_the_others() {
        let f = Front::new();
        let (a, b) = (0x100, 0x200);
        assert!(!std::ptr::eq(f.slot(a), f.slot(b)));
        f.keep(a, 512, 0x1000);
        f.keep(b, 512, 0x2000);
        let mut back = Vec::new();
        f.drain(Some(a), |p, s| back.push((p, s)));
        assert_eq!(back, [(0x1000, a)]);
        assert_eq!(f.take(b, 512), Some(0x2000));
        f.keep(b, 512, 0x2000);
        f.drain(None, |p, s| back.push((p, s)));
        assert_eq!(back, [(0x1000, a), (0x2000, b)]);
        assert_eq!(f.summary().0.len(), 0);
    }
}
