//! The pointer → block index: an open-addressing hash table that readers search without a
//! lock, so `free` and `record_event` find a block without touching any shared lock.
//!
//! Invariants the lock-free readers rely on:
//! - only one writer at a time (the caller holds the allocator's global lock);
//! - a slot's value is written before its key is published (`Release`), and readers load the
//!   key with `Acquire` before the value;
//! - removed keys become tombstones, never empty, so probe chains stay unbroken;
//! - a table that has been replaced by a larger one stays allocated until the index is
//!   dropped, so a reader holding the old one still reads valid memory (it may miss an entry
//!   inserted after the switch, which only happens for blocks it cannot have been handed yet).

use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicUsize, Ordering};

/// Key of a slot that never held an entry: ends a probe.
const EMPTY: usize = 0;
/// Key of a slot whose entry was removed: probes continue past it.
const TOMBSTONE: usize = usize::MAX;
/// Slots in the first table.
const INITIAL_SLOTS: usize = 256;

struct Slot {
    key: AtomicUsize,
    value: AtomicU32,
}

struct Table {
    slots: Box<[Slot]>,
    mask: usize,
    /// `64 - log2(slots)`: the hash keeps the product's high bits, which depend on every
    /// input bit (block addresses share their low bits).
    shift: u32,
    /// Slots that are not EMPTY (live entries and tombstones), owned by the writer.
    used: AtomicUsize,
    live: AtomicUsize,
}

impl Table {
    fn with_slots(n: usize) -> Table {
        let slots = (0..n)
            .map(|_| Slot {
                key: AtomicUsize::new(EMPTY),
                value: AtomicU32::new(0),
            })
            .collect::<Vec<_>>()
            .into_boxed_slice();
        Table {
            slots,
            mask: n - 1,
            shift: usize::BITS - n.trailing_zeros(),
            used: AtomicUsize::new(0),
            live: AtomicUsize::new(0),
        }
    }

    fn start(&self, key: usize) -> usize {
        // Fibonacci hashing.
        (key as u64)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_shr(self.shift) as usize
            & self.mask
    }

    fn get(&self, key: usize) -> Option<u32> {
        let mut i = self.start(key);
        for _ in 0..=self.mask {
            let slot = &self.slots[i];
            match slot.key.load(Ordering::Acquire) {
                EMPTY => return None,
                k if k == key => return Some(slot.value.load(Ordering::Relaxed)),
                _ => i = (i + 1) & self.mask,
            }
        }
        None
    }

    /// Writer only. Reuses the first tombstone on the probe path when the key is absent.
    fn insert(&self, key: usize, value: u32) {
        let mut i = self.start(key);
        let mut reuse = None;
        for _ in 0..=self.mask {
            let slot = &self.slots[i];
            match slot.key.load(Ordering::Relaxed) {
                EMPTY => break,
                TOMBSTONE => {
                    reuse.get_or_insert(i);
                }
                k if k == key => {
                    slot.value.store(value, Ordering::Release);
                    return;
                }
                _ => {}
            }
            i = (i + 1) & self.mask;
        }
        let target = match reuse {
            Some(t) => t,
            None => {
                self.used.fetch_add(1, Ordering::Relaxed);
                i
            }
        };
        let slot = &self.slots[target];
        slot.value.store(value, Ordering::Relaxed);
        slot.key.store(key, Ordering::Release);
        self.live.fetch_add(1, Ordering::Relaxed);
    }

    /// Writer only.
    fn remove(&self, key: usize) -> bool {
        let mut i = self.start(key);
        for _ in 0..=self.mask {
            let slot = &self.slots[i];
            match slot.key.load(Ordering::Relaxed) {
                EMPTY => return false,
                k if k == key => {
                    slot.key.store(TOMBSTONE, Ordering::Release);
                    self.live.fetch_sub(1, Ordering::Relaxed);
                    return true;
                }
                _ => i = (i + 1) & self.mask,
            }
        }
        false
    }
}

/// Maps the address of every block to its id.
pub(crate) struct PtrIndex {
    current: AtomicPtr<Table>,
    /// Every table ever made (the current one last); freed on drop.
    tables: parking_lot::Mutex<Vec<*mut Table>>,
}

// SAFETY: the raw table pointers are owned by the index, only freed in `drop`, and the tables
// themselves are made of atomics.
unsafe impl Send for PtrIndex {}
// SAFETY: as above; shared access only reads atomics or goes through the `tables` mutex.
unsafe impl Sync for PtrIndex {}

impl PtrIndex {
    pub(crate) fn new() -> PtrIndex {
        let first = Box::into_raw(Box::new(Table::with_slots(INITIAL_SLOTS)));
        PtrIndex {
            current: AtomicPtr::new(first),
            tables: parking_lot::Mutex::new(vec![first]),
        }
    }

    fn table(&self) -> &Table {
        // SAFETY: `current` always points to a table in `tables`, which lives until drop.
        unsafe { &*self.current.load(Ordering::Acquire) }
    }

    /// The block id stored for `ptr`. Lock-free.
    pub(crate) fn get(&self, ptr: usize) -> Option<u32> {
        if ptr == EMPTY || ptr == TOMBSTONE {
            return None;
        }
        self.table().get(ptr)
    }

    /// Maps `ptr` to `id`. The caller must be the only writer (it holds the global lock).
    pub(crate) fn insert(&self, ptr: usize, id: u32) {
        debug_assert!(ptr != EMPTY && ptr != TOMBSTONE);
        let table = self.table();
        // Keep at most half the slots in use so probes stay short.
        if (table.used.load(Ordering::Relaxed) + 1) * 2 > table.slots.len() {
            self.grow();
        }
        self.table().insert(ptr, id);
    }

    /// Removes `ptr`. The caller must be the only writer.
    pub(crate) fn remove(&self, ptr: usize) -> bool {
        self.table().remove(ptr)
    }

    /// Copies the live entries into a table sized for them and publishes it.
    fn grow(&self) {
        let old = self.table();
        let live = old.live.load(Ordering::Relaxed) + 1;
        let slots = (live * 4).next_power_of_two().max(INITIAL_SLOTS);
        let new = Table::with_slots(slots);
        for slot in old.slots.iter() {
            let key = slot.key.load(Ordering::Relaxed);
            if key != EMPTY && key != TOMBSTONE {
                new.insert(key, slot.value.load(Ordering::Relaxed));
            }
        }
        let new = Box::into_raw(Box::new(new));
        self.tables.lock().push(new);
        self.current.store(new, Ordering::Release);
    }
}

impl Drop for PtrIndex {
    fn drop(&mut self) {
        for t in self.tables.get_mut().drain(..) {
            // SAFETY: each pointer came from Box::into_raw in this index and is freed once; no
            // reader can exist while the index is being dropped.
            drop(unsafe { Box::from_raw(t) });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_finds_what_was_inserted_and_forgets_what_was_removed() {
        let index = PtrIndex::new();
        for i in 1..5000usize {
            index.insert(i << 12, i as u32);
        }
        for i in 1..5000usize {
            assert_eq!(index.get(i << 12), Some(i as u32));
        }
        assert_eq!(index.get(5000 << 12), None);
        for i in (1..5000usize).step_by(2) {
            assert!(index.remove(i << 12));
        }
        assert!(!index.remove(1 << 12));
        for i in 1..5000usize {
            assert_eq!(index.get(i << 12), (i % 2 == 0).then_some(i as u32));
        }
        index.insert(3 << 12, 77);
        assert_eq!(index.get(3 << 12), Some(77));
    }

    #[test]
    fn index_reports_reserved_keys_as_absent() {
        let index = PtrIndex::new();
        assert_eq!(index.get(0), None);
        assert_eq!(index.get(usize::MAX), None);
    }
}
