//! A shard's allocated blocks by address: the lookup of every free.
//!
//! An open-addressed table with linear probing, kept at most half full, and deletion by
//! shifting later entries of a run back (no tombstones, so lookups never slow down as blocks
//! come and go). Addresses are 512-byte aligned and distinct, so one multiply spreads them;
//! a general hash map spends more on hashing and group probing than the rest of a lookup.

/// Addresses of allocated blocks to block ids.
pub(crate) struct LiveTable {
    /// `(address, id)`; address 0 marks an empty slot. Empty, or a power of two long.
    slots: Vec<(usize, u32)>,
    /// Entries in `slots`.
    len: usize,
    /// 64 minus log2 of the capacity: a hash's top bits are its slot.
    shift: u32,
    /// The entry of address 0, which cannot live in `slots`.
    zero: Option<u32>,
}

impl Default for LiveTable {
    fn default() -> Self {
        LiveTable {
            slots: Vec::new(),
            len: 0,
            shift: 64,
            zero: None,
        }
    }
}

const FIRST_CAPACITY: usize = 64;

impl LiveTable {
    #[inline]
    fn home(&self, addr: usize) -> usize {
        ((addr as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> self.shift) as usize
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// The slot holding `addr` (not 0), if any.
    #[inline]
    fn find(&self, addr: usize) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.mask();
        let mut i = self.home(addr);
        loop {
            match self.slots[i].0 {
                a if a == addr => return Some(i),
                0 => return None,
                _ => i = (i + 1) & mask,
            }
        }
    }

    /// Maps `addr` to `id`; returns the id it mapped to before.
    #[inline(always)]
    pub fn insert(&mut self, addr: usize, id: u32) -> Option<u32> {
        if addr == 0 {
            return self.zero.replace(id);
        }
        if (self.len + 1) * 2 > self.slots.len() {
            self.grow();
        }
        let mask = self.mask();
        let mut i = self.home(addr);
        loop {
            let slot = &mut self.slots[i];
            if slot.0 == addr {
                return Some(std::mem::replace(&mut slot.1, id));
            }
            if slot.0 == 0 {
                *slot = (addr, id);
                self.len += 1;
                return None;
            }
            i = (i + 1) & mask;
        }
    }

    #[cold]
    fn grow(&mut self) {
        let capacity = (self.slots.len() * 2).max(FIRST_CAPACITY);
        let old = std::mem::replace(&mut self.slots, vec![(0, 0); capacity]);
        self.shift = 64 - capacity.trailing_zeros();
        let mask = capacity - 1;
        for (addr, id) in old.into_iter().filter(|e| e.0 != 0) {
            let mut i = self.home(addr);
            while self.slots[i].0 != 0 {
                i = (i + 1) & mask;
            }
            self.slots[i] = (addr, id);
        }
    }

    /// Removes `addr`; returns its id, if it was mapped.
    #[inline(always)]
    pub fn remove(&mut self, addr: &usize) -> Option<u32> {
        if *addr == 0 {
            return self.zero.take();
        }
        let mut hole = self.find(*addr)?;
        let id = self.slots[hole].1;
        self.len -= 1;
        // Entries after the hole in its run move back into it unless that would put them
        // before their home slot.
        let mask = self.mask();
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let (a, _) = self.slots[j];
            if a == 0 {
                break;
            }
            let home = self.home(a);
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.slots[hole] = self.slots[j];
                hole = j;
            }
        }
        self.slots[hole] = (0, 0);
        Some(id)
    }

    /// The id mapped to `addr`.
    #[inline]
    pub fn get(&self, addr: &usize) -> Option<&u32> {
        if *addr == 0 {
            return self.zero.as_ref();
        }
        self.find(*addr).map(|i| &self.slots[i].1)
    }

    pub fn contains_key(&self, addr: &usize) -> bool {
        self.get(addr).is_some()
    }

    /// Whether no address is mapped.
    pub fn is_empty(&self) -> bool {
        self.len == 0 && self.zero.is_none()
    }

    /// Every mapped id, in no particular order.
    pub fn values(&self) -> impl Iterator<Item = &u32> {
        self.slots
            .iter()
            .filter(|e| e.0 != 0)
            .map(|e| &e.1)
            .chain(self.zero.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::xorshift;
    use std::collections::HashMap;

    #[test]
    fn the_table_agrees_with_a_hash_map_through_growth_and_removals() {
        let mut table = LiveTable::default();
        let mut model = HashMap::new();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for step in 0..200_000u32 {
            xorshift(&mut x);
            // Few distinct addresses, so that runs collide, wrap and shift back; 0 included.
            let addr = ((x >> 20) % 3000) as usize * 512;
            // Grow past several capacities, then shrink.
            let insert = if (step / 50_000) % 2 == 0 {
                !x.is_multiple_of(3)
            } else {
                x.is_multiple_of(3)
            };
            if insert {
                assert_eq!(table.insert(addr, step), model.insert(addr, step));
            } else {
                assert_eq!(table.remove(&addr), model.remove(&addr));
            }
            let probe = ((x >> 40) % 3000) as usize * 512;
            assert_eq!(table.get(&probe), model.get(&probe));
            assert_eq!(table.contains_key(&probe), model.contains_key(&probe));
        }
        let mut ids: Vec<u32> = table.values().copied().collect();
        let mut expected: Vec<u32> = model.values().copied().collect();
        ids.sort();
        expected.sort();
        assert_eq!(ids, expected);
    }
}
