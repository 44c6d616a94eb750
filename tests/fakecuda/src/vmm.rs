//! The fake driver's virtual memory management (`cuMemAddressReserve`, `cuMemCreate`,
//! `cuMemMap`, `cuMemSetAccess`, `cuMemUnmap`, `cuMemRelease`).
//!
//! Reserved ranges are `PROT_NONE` host mappings; each physical allocation is a memfd, so two
//! mappings of one allocation share their bytes as they do on a GPU; mapped ranges stay
//! inaccessible until `cuMemSetAccess`. Physical allocations count against the simulated
//! device's capacity (they are charged as an allocation of the simulated device whose pages are
//! never touched), so `cuMemGetInfo` and out-of-memory behave as on a real device.

use std::collections::{BTreeMap, HashMap};

use parking_lot::Mutex;
use tensoralloc::driver::Driver;

use crate::state::Fake;
use crate::types::*;

/// Granularity of physical allocations and mappings (2 MiB, as on current NVIDIA GPUs).
pub const GRANULARITY: usize = 2 << 20;

const MEM_ALLOCATION_TYPE_PINNED: u32 = 1;
const MEM_LOCATION_TYPE_DEVICE: u32 = 1;

struct Physical {
    device: usize,
    size: usize,
    fd: i32,
    /// The simulated-device allocation that stands for this memory in the capacity count.
    charge: usize,
    maps: usize,
    released: bool,
}

struct Mapping {
    size: usize,
    handle: u64,
}

#[derive(Default)]
struct VmmState {
    /// Reserved ranges: start -> size.
    reservations: BTreeMap<u64, usize>,
    /// Mapped ranges: start -> mapping.
    mappings: BTreeMap<u64, Mapping>,
    handles: HashMap<u64, Physical>,
    next_handle: u64,
}

/// Virtual memory state of the fake driver.
#[derive(Default)]
pub struct Vmm {
    state: Mutex<VmmState>,
}

fn aligned(v: u64) -> bool {
    v.is_multiple_of(GRANULARITY as u64)
}

/// Checks a `CUmemAllocationProp` and returns its device.
pub fn prop_device(fake: &Fake, prop: &CUmemAllocationProp) -> Result<usize, CUresult> {
    if prop.type_ != MEM_ALLOCATION_TYPE_PINNED || prop.location.type_ != MEM_LOCATION_TYPE_DEVICE {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    fake.device(prop.location.id)
        .map_err(|_| CUDA_ERROR_INVALID_DEVICE)
}

/// Replaces `[ptr, ptr + size)` by an inaccessible reservation.
fn make_reserved(ptr: u64, size: usize) -> Result<(), CUresult> {
    // SAFETY: the range lies inside a reservation this module made; MAP_FIXED only replaces
    // our own mapping there.
    let p = unsafe {
        libc::mmap(
            ptr as *mut libc::c_void,
            size,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        Err(CUDA_ERROR_OUT_OF_MEMORY)
    } else {
        Ok(())
    }
}

impl Vmm {
    pub fn reserve(&self, size: usize, alignment: usize) -> Result<u64, CUresult> {
        if size == 0 || !aligned(size as u64) || (alignment != 0 && !alignment.is_power_of_two()) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let alignment = alignment.max(GRANULARITY);
        let span = size
            .checked_add(alignment)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: a fresh anonymous inaccessible mapping with no address hint.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let base = p as usize;
        let start = base.next_multiple_of(alignment);
        // SAFETY: trims the parts of the mapping just made that lie outside [start, start+size).
        unsafe {
            if start > base {
                libc::munmap(p, start - base);
            }
            let end = start + size;
            if base + span > end {
                libc::munmap(end as *mut libc::c_void, base + span - end);
            }
        }
        self.state.lock().reservations.insert(start as u64, size);
        Ok(start as u64)
    }

    pub fn address_free(&self, ptr: u64, size: usize) -> Result<(), CUresult> {
        let mut st = self.state.lock();
        if st.reservations.get(&ptr) != Some(&size) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if st.mappings.range(ptr..ptr + size as u64).next().is_some() {
            // Still mapped: a real driver refuses too.
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        st.reservations.remove(&ptr);
        // SAFETY: the reservation made by `reserve`, removed from the table above.
        unsafe { libc::munmap(ptr as *mut libc::c_void, size) };
        Ok(())
    }

    pub fn create(&self, fake: &Fake, size: usize, device: usize) -> Result<u64, CUresult> {
        if size == 0 || !aligned(size as u64) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let charge = fake
            .sim
            .mem_alloc(device, size)
            .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
        // SAFETY: memfd_create with a static NUL-terminated name.
        let fd = unsafe { libc::memfd_create(c"fakecuda-vmm".as_ptr(), libc::MFD_CLOEXEC) };
        // SAFETY: `fd` is ours when non-negative.
        if fd < 0 || unsafe { libc::ftruncate(fd, size as libc::off_t) } != 0 {
            if fd >= 0 {
                // SAFETY: closes the descriptor just opened.
                unsafe { libc::close(fd) };
            }
            let _ = fake.sim.mem_free(device, charge);
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let mut st = self.state.lock();
        st.next_handle += 1;
        let handle = 0xa000_0000 + st.next_handle;
        st.handles.insert(
            handle,
            Physical {
                device,
                size,
                fd,
                charge,
                maps: 0,
                released: false,
            },
        );
        Ok(handle)
    }

    pub fn map(&self, ptr: u64, size: usize, offset: usize, handle: u64) -> Result<(), CUresult> {
        let mut st = self.state.lock();
        let phys = st
            .handles
            .get(&handle)
            .filter(|p| !p.released)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if size == 0 || !aligned(ptr) || !aligned(size as u64) || !aligned(offset as u64) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if offset.checked_add(size).is_none_or(|end| end > phys.size) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let end = ptr + size as u64;
        let inside = st
            .reservations
            .range(..=ptr)
            .next_back()
            .is_some_and(|(&s, &len)| end <= s + len as u64);
        let overlaps = st
            .mappings
            .range(..end)
            .next_back()
            .is_some_and(|(&s, m)| s + m.size as u64 > ptr);
        if !inside || overlaps {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let fd = phys.fd;
        // SAFETY: [ptr, end) lies inside one of our reservations and is not mapped; MAP_FIXED
        // replaces our inaccessible reservation pages with the allocation's pages.
        let p = unsafe {
            libc::mmap(
                ptr as *mut libc::c_void,
                size,
                libc::PROT_NONE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd,
                offset as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        st.handles.get_mut(&handle).expect("checked above").maps += 1;
        st.mappings.insert(ptr, Mapping { size, handle });
        Ok(())
    }

    /// The mappings that exactly tile `[ptr, ptr + size)`, as (start, size).
    fn tiling(st: &VmmState, ptr: u64, size: usize) -> Result<Vec<(u64, usize)>, CUresult> {
        let end = ptr + size as u64;
        let mut at = ptr;
        let mut out = Vec::new();
        for (&s, m) in st.mappings.range(ptr..end) {
            if s != at {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            out.push((s, m.size));
            at = s + m.size as u64;
        }
        if at != end || out.is_empty() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(out)
    }

    pub fn set_access(
        &self,
        fake: &Fake,
        ptr: u64,
        size: usize,
        descs: &[CUmemAccessDesc],
    ) -> Result<(), CUresult> {
        if descs.is_empty() || size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut prot = libc::PROT_NONE;
        for d in descs {
            if d.location.type_ != MEM_LOCATION_TYPE_DEVICE {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            fake.device(d.location.id)?;
            prot = match d.flags {
                0 => prot,
                1 => prot | libc::PROT_READ,
                3 => libc::PROT_READ | libc::PROT_WRITE,
                _ => return Err(CUDA_ERROR_INVALID_VALUE),
            };
        }
        let st = self.state.lock();
        Self::tiling(&st, ptr, size)?;
        // SAFETY: the range is exactly covered by our own mappings.
        if unsafe { libc::mprotect(ptr as *mut libc::c_void, size, prot) } != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(())
    }

    pub fn unmap(&self, fake: &Fake, ptr: u64, size: usize) -> Result<(), CUresult> {
        let mut st = self.state.lock();
        let pieces = Self::tiling(&st, ptr, size)?;
        make_reserved(ptr, size)?;
        for (s, _) in pieces {
            let m = st.mappings.remove(&s).expect("tiling found it");
            let phys = st.handles.get_mut(&m.handle).expect("mapped handles exist");
            phys.maps -= 1;
            if phys.released && phys.maps == 0 {
                let phys = st.handles.remove(&m.handle).expect("present");
                Self::destroy(fake, phys);
            }
        }
        Ok(())
    }

    /// Releases a physical allocation; its memory goes back once no mapping uses it.
    pub fn release(&self, fake: &Fake, handle: u64) -> Result<(), CUresult> {
        let mut st = self.state.lock();
        let phys = st
            .handles
            .get_mut(&handle)
            .filter(|p| !p.released)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        phys.released = true;
        if phys.maps == 0 {
            let phys = st.handles.remove(&handle).expect("present");
            Self::destroy(fake, phys);
        }
        Ok(())
    }

    fn destroy(fake: &Fake, phys: Physical) {
        // SAFETY: the descriptor was opened by `create` and is closed once, here.
        unsafe { libc::close(phys.fd) };
        let _ = fake.sim.mem_free(phys.device, phys.charge);
        debug_assert!(phys.size > 0);
    }
}
