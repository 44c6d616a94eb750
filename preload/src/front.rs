//! Blocks kept aside for the next allocation of their size, so that the commonest pattern (free
//! a buffer, allocate one of the same size) skips the caching allocator's free lists and
//! statistics both ways. Two kinds, one [`Front`] per kind and device:
//!
//! - by stream: blocks freed in stream order on the stream they were allocated on, which stream
//!   order makes reusable there at once (all the allocator would do with them too);
//! - by size: blocks of synchronous allocations whose batch of frees has completed, reusable
//!   anywhere.
//!
//! The blocks stay allocated in the allocator's view until they are given back: when their slot
//! is needed for another key or is full, when their stream is destroyed, and when memory runs
//! short. Only small blocks are kept, a bounded number of bytes per slot, so what this holds is
//! bounded (`SLOTS * SLOT_BYTES` per front) and counted as free memory.

use parking_lot::Mutex;

/// Largest request kept aside (the caching allocator's small-block limit).
pub const MAX_BYTES: usize = 1 << 20;
/// Bytes (asked for) one slot keeps at most.
const SLOT_BYTES: usize = 4 << 20;
const SLOTS: usize = 16;
/// Blocks one slot holds at most.
const MAX_WAYS: usize = 64;
/// The key of a slot that holds nothing (neither a stream handle nor a size of at most
/// `MAX_BYTES`).
const NO_KEY: usize = usize::MAX;

/// A block kept aside: its address and the size it was asked for.
#[derive(Clone, Copy)]
struct Kept {
    ptr: usize,
    size: usize,
}

struct Slot {
    key: usize,
    kept: [Kept; MAX_WAYS],
    len: usize,
    bytes: usize,
    /// Allocations served from this slot.
    hits: u64,
}

#[repr(align(64))]
struct Padded(Mutex<Slot>);

/// Blocks kept aside under keys (a stream handle, or a size).
pub struct Front {
    slots: [Padded; SLOTS],
    /// Blocks one slot holds at most (at most `MAX_WAYS`).
    ways: usize,
}

impl Front {
    /// A front whose slots hold at most `ways` blocks each.
    pub fn new(ways: usize) -> Self {
        Front {
            slots: std::array::from_fn(|_| {
                Padded(Mutex::new(Slot {
                    key: NO_KEY,
                    kept: [Kept { ptr: 0, size: 0 }; MAX_WAYS],
                    len: 0,
                    bytes: 0,
                    hits: 0,
                }))
            }),
            ways: ways.min(MAX_WAYS),
        }
    }

    #[inline]
    fn slot(&self, key: usize) -> &Mutex<Slot> {
        let h = (key as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        &self.slots[(h >> (64 - SLOTS.trailing_zeros())) as usize].0
    }

    /// A block of exactly `size` bytes kept under `key`, if there is one.
    #[inline]
    pub fn take(&self, key: usize, size: usize) -> Option<usize> {
        let mut s = self.slot(key).lock();
        if s.key != key {
            return None;
        }
        let i = s.kept[..s.len].iter().rposition(|k| k.size == size)?;
        let ptr = s.kept[i].ptr;
        s.len -= 1;
        let last = s.len;
        s.kept[i] = s.kept[last];
        s.bytes -= size;
        s.hits += 1;
        Some(ptr)
    }

    /// Keeps the block at `ptr` (`size` bytes asked for, at most [`MAX_BYTES`]) under `key`.
    /// The blocks it displaces, and the block itself when it does not fit, go to
    /// `give_back(ptr, key they were kept under)`, called with the slot locked.
    #[inline]
    pub fn keep(
        &self,
        key: usize,
        size: usize,
        ptr: usize,
        mut give_back: impl FnMut(usize, usize),
    ) {
        let mut s = self.slot(key).lock();
        if s.key != key {
            // Another key's blocks leave the slot.
            spill_all(&mut s, &mut give_back);
            s.key = key;
        }
        if s.len == self.ways || s.bytes + size > SLOT_BYTES {
            give_back(ptr, key);
            return;
        }
        let len = s.len;
        s.kept[len] = Kept { ptr, size };
        s.len += 1;
        s.bytes += size;
    }

    /// Gives back every block kept under `key` (a destroyed stream: its handle may name another
    /// stream later), or under every key with `None` (memory is short).
    pub fn drain(&self, key: Option<usize>, mut give_back: impl FnMut(usize, usize)) {
        let mut drain_slot = |slot: &Mutex<Slot>| {
            let mut s = slot.lock();
            if key.is_none_or(|k| s.key == k) {
                spill_all(&mut s, &mut give_back);
            }
        };
        match key {
            Some(k) => drain_slot(self.slot(k)),
            None => self.slots.iter().for_each(|p| drain_slot(&p.0)),
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

fn spill_all(s: &mut Slot, give_back: &mut impl FnMut(usize, usize)) {
    for k in &s.kept[..s.len] {
        give_back(k.ptr, s.key);
    }
    s.len = 0;
    s.bytes = 0;
    s.key = NO_KEY;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keeps a block and returns what was given back.
    fn keep(f: &Front, key: usize, size: usize, ptr: usize) -> Vec<(usize, usize)> {
        let mut back = Vec::new();
        f.keep(key, size, ptr, |p, k| back.push((p, k)));
        back
    }

    #[test]
    fn a_kept_block_comes_back_for_its_key_and_size_only() {
        let f = Front::new(4);
        assert_eq!(keep(&f, 0x100, 4096, 0xa000), []);
        assert_eq!(f.take(0x200, 4096), None);
        assert_eq!(f.take(0x100, 8192), None);
        assert_eq!(f.take(0x100, 4096), Some(0xa000));
        assert_eq!(f.take(0x100, 4096), None);
    }

    #[test]
    fn a_full_slot_gives_back_the_new_block() {
        let f = Front::new(4);
        for i in 0..4 {
            assert_eq!(keep(&f, 0x100, 512, 0x1000 * (i + 1)), []);
        }
        assert_eq!(keep(&f, 0x100, 512, 0x9000), [(0x9000, 0x100)]);
    }

    #[test]
    fn a_slot_keeps_a_bounded_number_of_bytes() {
        let f = Front::new(MAX_WAYS);
        for i in 0..SLOT_BYTES / MAX_BYTES {
            assert_eq!(keep(&f, MAX_BYTES, MAX_BYTES, 0x10_0000 * (i + 1)), []);
        }
        assert_eq!(
            keep(&f, MAX_BYTES, MAX_BYTES, 0xf00_0000),
            [(0xf00_0000, MAX_BYTES)]
        );
    }

    #[test]
    fn another_key_in_the_same_slot_displaces_every_block_of_the_first() {
        let f = Front::new(4);
        let first = 0x100;
        let other = (0x200..)
            .step_by(0x100)
            .find(|&k| std::ptr::eq(f.slot(k), f.slot(first)))
            .unwrap();
        keep(&f, first, 512, 0x1000);
        keep(&f, first, 1024, 0x2000);
        assert_eq!(
            keep(&f, other, 512, 0x3000),
            [(0x1000, first), (0x2000, first)]
        );
        assert_eq!(f.take(first, 512), None);
        assert_eq!(f.take(other, 512), Some(0x3000));
    }

    #[test]
    fn draining_a_key_gives_back_its_blocks_and_keeps_the_others() {
        let f = Front::new(4);
        let (a, b) = (0x100, 0x200);
        assert!(!std::ptr::eq(f.slot(a), f.slot(b)));
        keep(&f, a, 512, 0x1000);
        keep(&f, b, 512, 0x2000);
        let mut back = Vec::new();
        f.drain(Some(a), |p, k| back.push((p, k)));
        assert_eq!(back, [(0x1000, a)]);
        assert_eq!(f.take(b, 512), Some(0x2000));
        keep(&f, b, 512, 0x2000);
        f.drain(None, |p, k| back.push((p, k)));
        assert_eq!(back, [(0x1000, a), (0x2000, b)]);
        assert_eq!(f.summary().0.len(), 0);
    }
}
