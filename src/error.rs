//! The one error type of the library. Each variant maps to a C status code; the message is
//! what `tensoralloc_last_error()` shows.

use std::fmt;

/// What went wrong, with a message written for the person reading the last error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// The caller passed something the function cannot accept.
    InvalidArgument(String),
    /// The device (or host) has no memory left for the request, even after freeing the cache.
    OutOfMemory(String),
    /// The driver refused a call; the message names the driver's error.
    Driver(String),
    /// No usable driver could be loaded or selected.
    NoDriver(String),
    /// A pointer that this allocator does not own (or no longer owns).
    UnknownPointer(String),
    /// A configuration string could not be parsed.
    Config(String),
    /// An internal invariant failed; the operation was abandoned without corrupting state.
    Internal(String),
}

/// Results of the library.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// The message without the kind.
    pub fn message(&self) -> &str {
        match self {
            Error::InvalidArgument(m)
            | Error::OutOfMemory(m)
            | Error::Driver(m)
            | Error::NoDriver(m)
            | Error::UnknownPointer(m)
            | Error::Config(m)
            | Error::Internal(m) => m,
        }
    }

    /// A short name of the kind, as printed before the message.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::InvalidArgument(_) => "invalid argument",
            Error::OutOfMemory(_) => "out of memory",
            Error::Driver(_) => "driver error",
            Error::NoDriver(_) => "no driver",
            Error::UnknownPointer(_) => "unknown pointer",
            Error::Config(_) => "bad configuration",
            Error::Internal(_) => "internal error",
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind(), self.message())
    }
}

impl std::error::Error for Error {}
