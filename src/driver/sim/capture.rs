//! Simulated CUDA graph capture: which streams are capturing, and whether a capture was
//! invalidated by a call that a real driver forbids during capture.
//!
//! A real driver (in the default, global capture mode) invalidates a capture when the thread
//! that began it makes a "potentially unsafe" call before it ends: querying or waiting for an
//! event, freeing device memory. The simulation applies that rule to the calling thread's own
//! captures only, so tests running side by side on other threads cannot disturb each other.
//! Capture state is process-wide, like stream holds (stream handles are global in CUDA).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::thread::ThreadId;

use once_cell::sync::Lazy;
use parking_lot::Mutex;

use super::Stream;
use crate::error::{Error, Result};

struct Capture {
    thread: ThreadId,
    /// Why the capture was invalidated, if it was.
    invalidated: Option<String>,
}

static CAPTURES: Lazy<Mutex<HashMap<Stream, Capture>>> = Lazy::new(|| Mutex::new(HashMap::new()));
/// Captures underway, so that the common case (none) takes no lock.
static UNDERWAY: AtomicUsize = AtomicUsize::new(0);

/// Starts capturing `stream` on behalf of the calling thread. Fails if it already captures.
pub fn begin_capture(stream: Stream) -> Result<()> {
    let mut captures = CAPTURES.lock();
    if captures.contains_key(&stream) {
        return Err(Error::InvalidArgument(format!(
            "stream {stream:#x} is already capturing (CUDA_ERROR_ILLEGAL_STATE)"
        )));
    }
    captures.insert(
        stream,
        Capture {
            thread: std::thread::current().id(),
            invalidated: None,
        },
    );
    UNDERWAY.fetch_add(1, Relaxed);
    Ok(())
}

/// Ends the capture of `stream`. Fails when the stream was not capturing, or when the capture
/// was invalidated (the error says by what), as `cuStreamEndCapture` does with
/// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`.
pub fn end_capture(stream: Stream) -> Result<()> {
    let capture = CAPTURES.lock().remove(&stream).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "stream {stream:#x} is not capturing (CUDA_ERROR_ILLEGAL_STATE)"
        ))
    })?;
    UNDERWAY.fetch_sub(1, Relaxed);
    match capture.invalidated {
        None => Ok(()),
        Some(why) => Err(Error::Driver(format!(
            "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: the capture of stream {stream:#x} was invalidated by {why}"
        ))),
    }
}

/// Whether `stream` is capturing.
pub fn is_capturing(stream: Stream) -> bool {
    UNDERWAY.load(Relaxed) != 0 && CAPTURES.lock().contains_key(&stream)
}

/// Whether the calling thread has a capture underway.
pub fn thread_is_capturing() -> bool {
    if UNDERWAY.load(Relaxed) == 0 {
        return false;
    }
    let me = std::thread::current().id();
    CAPTURES.lock().values().any(|c| c.thread == me)
}

/// The calling thread made `call`, which a driver forbids while that thread captures:
/// invalidates the thread's captures. Cheap when nothing captures.
pub fn unsafe_call(call: &str) {
    if UNDERWAY.load(Relaxed) == 0 {
        return;
    }
    let mut captures = CAPTURES.lock();
    let me = std::thread::current().id();
    for c in captures.values_mut().filter(|c| c.thread == me) {
        c.invalidated.get_or_insert_with(|| call.to_string());
    }
}
