//! C functions of memory history and snapshots: record the allocator's events and write them,
//! with the segments and blocks, as a PyTorch `_dump_snapshot` pickle.

use std::ffi::c_char;
use std::path::Path;

use super::{ffi_boundary, opt_str, status, tensoralloc_status};
use crate::device::history;
use crate::error::{Error, Result};
use crate::runtime::Runtime;

fn record(enabled: bool, max_entries: usize) -> Result<()> {
    let rt = Runtime::get()?;
    for index in 0..rt.device_count() {
        rt.device(index)?.history().set(enabled, max_entries)?;
    }
    Ok(())
}

/// Starts (`enabled` != 0) or stops (`enabled` == 0) recording the memory history of every
/// device: each allocation, free (requested and completed), segment allocation and release,
/// and out-of-memory failure, like PyTorch's `torch.cuda.memory._record_memory_history`.
/// Starting discards earlier events and keeps at most the last `max_entries` events per
/// device (1 to 67108864; ignored when stopping). Stopping keeps the recorded events for
/// `tensoralloc_dump_snapshot`. Returns `TENSORALLOC_OK`, or `TENSORALLOC_ERR_INVALID_ARGUMENT`
/// for a `max_entries` out of range (with a last error); nothing changes on error.
#[no_mangle]
pub extern "C" fn tensoralloc_record_memory_history(
    enabled: i32,
    max_entries: usize,
) -> tensoralloc_status {
    ffi_boundary! {
        if enabled != 0 && (max_entries == 0 || max_entries > history::MAX_ENTRIES) {
            return status(Err(Error::InvalidArgument(format!(
                "max_entries must be from 1 to {}, got {max_entries}",
                history::MAX_ENTRIES
            ))));
        }
        status(record(enabled != 0, max_entries))
    }
}

/// Writes a memory snapshot to the file `path` (a NUL-terminated UTF-8 path; the file is
/// created or replaced: written beside it and renamed over it once complete, so a failed dump
/// leaves an earlier file whole; a link is followed, and a device such as `/dev/stdout` is
/// written in place) in the layout of PyTorch's `torch.cuda.memory._dump_snapshot`: the
/// segments and blocks of every device now, the recorded events of each device (see
/// `tensoralloc_record_memory_history`; none if recording was never started) and the allocator
/// settings. A path ending in `.gz` is gzip-compressed. Stack frames are empty. PyTorch's
/// memory viewer and `tensoralloc replay` read the file. Returns `TENSORALLOC_OK`, or
/// `TENSORALLOC_ERR_INVALID_ARGUMENT` for a NULL path or a file that cannot be written (with a
/// last error).
#[no_mangle]
pub extern "C" fn tensoralloc_dump_snapshot(path: *const c_char) -> tensoralloc_status {
    ffi_boundary! {
        // SAFETY: the caller passes NULL or a NUL-terminated string, as documented.
        let path = match unsafe { opt_str(path, "path") } {
            Ok(Some(p)) => p,
            Ok(None) => return status(Err(Error::InvalidArgument("path is NULL".into()))),
            Err(e) => return status(Err(e)),
        };
        status(Runtime::get().and_then(|rt| {
            history::dump_snapshot(Path::new(path), rt.devices(), rt.config())
        }))
    }
}
