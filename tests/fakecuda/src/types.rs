//! The driver API types the fake exports, spelled with the names NVIDIA's `cuda.h` gives them,
//! so that the prototype check can write each exported signature in C and let the compiler
//! compare it with NVIDIA's declaration.
//!
//! Enumerations are plain integers here: the fake reads them from callers and must not assume
//! the values are valid.

#![allow(non_camel_case_types)]

use std::ffi::{c_int, c_uint, c_ulonglong};

/// `CUresult`: a `cudaError_enum` value.
pub type CUresult = c_uint;
/// `CUdevice`: a device ordinal.
pub type CUdevice = c_int;
/// `CUdeviceptr`: a device address.
pub type CUdeviceptr = c_ulonglong;
/// `CUmemGenericAllocationHandle`: a physical allocation made by `cuMemCreate`.
pub type CUmemGenericAllocationHandle = c_ulonglong;
/// `CUstreamCaptureStatus` (an enumeration).
pub type CUstreamCaptureStatus = c_uint;
/// `CUstreamCaptureMode` (an enumeration).
pub type CUstreamCaptureMode = c_uint;
/// `cuuint64_t`.
pub type cuuint64_t = u64;
/// `CUmemAllocationGranularity_flags` (an enumeration).
pub type CUmemAllocationGranularity_flags = c_uint;

/// Opaque context object (`struct CUctx_st`).
#[repr(C)]
pub struct CUctx_st {
    _opaque: [u8; 0],
}
/// Opaque event object (`struct CUevent_st`).
#[repr(C)]
pub struct CUevent_st {
    _opaque: [u8; 0],
}
/// Opaque stream object (`struct CUstream_st`).
#[repr(C)]
pub struct CUstream_st {
    _opaque: [u8; 0],
}

/// Opaque graph object (`struct CUgraph_st`).
#[repr(C)]
pub struct CUgraph_st {
    _opaque: [u8; 0],
}
/// Opaque graph node object (`struct CUgraphNode_st`).
#[repr(C)]
pub struct CUgraphNode_st {
    _opaque: [u8; 0],
}

/// Opaque graph edge data (`CUgraphEdgeData`, a structure the fake never reads).
#[repr(C)]
pub struct CUgraphEdgeData {
    _opaque: [u8; 0],
}

/// `CUgraph`.
pub type CUgraph = *mut CUgraph_st;
/// `CUgraphNode`.
pub type CUgraphNode = *mut CUgraphNode_st;
/// `CUcontext`.
pub type CUcontext = *mut CUctx_st;
/// `CUevent`.
pub type CUevent = *mut CUevent_st;
/// `CUstream`.
pub type CUstream = *mut CUstream_st;

/// `CUmemLocation`: where a physical allocation lives.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUmemLocation {
    /// `CUmemLocationType` (1 = device).
    pub type_: c_uint,
    /// The device ordinal for device locations.
    pub id: c_int,
}

/// The `allocFlags` member of `CUmemAllocationProp`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUmemAllocationPropFlags {
    pub compression_type: u8,
    pub gpu_direct_rdma_capable: u8,
    pub usage: u16,
    pub reserved: [u8; 4],
}

/// `CUmemAllocationProp`: the properties of a `cuMemCreate` allocation.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUmemAllocationProp {
    /// `CUmemAllocationType` (1 = pinned).
    pub type_: c_uint,
    /// `CUmemAllocationHandleType`.
    pub requested_handle_types: c_uint,
    pub location: CUmemLocation,
    pub win32_handle_meta_data: *mut std::ffi::c_void,
    pub alloc_flags: CUmemAllocationPropFlags,
}

/// `CUmemAccessDesc`: who may access a mapped range, and how.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUmemAccessDesc {
    pub location: CUmemLocation,
    /// `CUmemAccess_flags` (0 none, 1 read, 3 read-write).
    pub flags: c_uint,
}

/// `CUipcMemHandle`: an opaque 64-byte handle for sharing memory between processes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUipcMemHandle {
    pub reserved: [std::ffi::c_char; 64],
}

/// The size of every named type above, for the prototype check to compare with `cuda.h`.
pub const TYPE_SIZES: &[(&str, usize)] = &[
    ("CUresult", std::mem::size_of::<CUresult>()),
    ("CUdevice", std::mem::size_of::<CUdevice>()),
    ("CUdeviceptr", std::mem::size_of::<CUdeviceptr>()),
    (
        "CUmemGenericAllocationHandle",
        std::mem::size_of::<CUmemGenericAllocationHandle>(),
    ),
    (
        "CUmemAllocationGranularity_flags",
        std::mem::size_of::<CUmemAllocationGranularity_flags>(),
    ),
    ("CUmemLocation", std::mem::size_of::<CUmemLocation>()),
    (
        "CUmemAllocationProp",
        std::mem::size_of::<CUmemAllocationProp>(),
    ),
    ("CUmemAccessDesc", std::mem::size_of::<CUmemAccessDesc>()),
    ("CUipcMemHandle", std::mem::size_of::<CUipcMemHandle>()),
    (
        "CUstreamCaptureStatus",
        std::mem::size_of::<CUstreamCaptureStatus>(),
    ),
    (
        "CUstreamCaptureMode",
        std::mem::size_of::<CUstreamCaptureMode>(),
    ),
    ("cuuint64_t", std::mem::size_of::<cuuint64_t>()),
];

/// Field offsets of the structures above, as (C type, C member, offset).
pub const FIELD_OFFSETS: &[(&str, &str, usize)] = &[
    (
        "CUmemLocation",
        "type",
        std::mem::offset_of!(CUmemLocation, type_),
    ),
    (
        "CUmemLocation",
        "id",
        std::mem::offset_of!(CUmemLocation, id),
    ),
    (
        "CUmemAllocationProp",
        "type",
        std::mem::offset_of!(CUmemAllocationProp, type_),
    ),
    (
        "CUmemAllocationProp",
        "requestedHandleTypes",
        std::mem::offset_of!(CUmemAllocationProp, requested_handle_types),
    ),
    (
        "CUmemAllocationProp",
        "location",
        std::mem::offset_of!(CUmemAllocationProp, location),
    ),
    (
        "CUmemAllocationProp",
        "win32HandleMetaData",
        std::mem::offset_of!(CUmemAllocationProp, win32_handle_meta_data),
    ),
    (
        "CUmemAllocationProp",
        "allocFlags",
        std::mem::offset_of!(CUmemAllocationProp, alloc_flags),
    ),
    (
        "CUmemAccessDesc",
        "location",
        std::mem::offset_of!(CUmemAccessDesc, location),
    ),
    (
        "CUmemAccessDesc",
        "flags",
        std::mem::offset_of!(CUmemAccessDesc, flags),
    ),
];

// Status codes the fake returns (values from NVIDIA's cudaError_enum).
pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub const CUDA_ERROR_INVALID_DEVICE: CUresult = 101;
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
pub const CUDA_ERROR_INVALID_HANDLE: CUresult = 400;
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
pub const CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: CUresult = 712;
pub const CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: CUresult = 713;
pub const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;
pub const CUDA_ERROR_UNKNOWN: CUresult = 999;

/// Name and description of each status code, as `cuGetErrorName` / `cuGetErrorString` give them.
pub const ERROR_TEXT: &[(CUresult, &std::ffi::CStr, &std::ffi::CStr)] = &[
    (CUDA_SUCCESS, c"CUDA_SUCCESS", c"no error"),
    (
        CUDA_ERROR_INVALID_VALUE,
        c"CUDA_ERROR_INVALID_VALUE",
        c"invalid argument",
    ),
    (
        CUDA_ERROR_OUT_OF_MEMORY,
        c"CUDA_ERROR_OUT_OF_MEMORY",
        c"out of memory",
    ),
    (
        CUDA_ERROR_NOT_INITIALIZED,
        c"CUDA_ERROR_NOT_INITIALIZED",
        c"initialization error",
    ),
    (4, c"CUDA_ERROR_DEINITIALIZED", c"driver shutting down"),
    (
        100,
        c"CUDA_ERROR_NO_DEVICE",
        c"no CUDA-capable device is detected",
    ),
    (
        CUDA_ERROR_INVALID_DEVICE,
        c"CUDA_ERROR_INVALID_DEVICE",
        c"invalid device ordinal",
    ),
    (
        CUDA_ERROR_INVALID_CONTEXT,
        c"CUDA_ERROR_INVALID_CONTEXT",
        c"invalid device context",
    ),
    (
        CUDA_ERROR_INVALID_HANDLE,
        c"CUDA_ERROR_INVALID_HANDLE",
        c"invalid resource handle",
    ),
    (500, c"CUDA_ERROR_NOT_FOUND", c"named symbol not found"),
    (
        CUDA_ERROR_NOT_READY,
        c"CUDA_ERROR_NOT_READY",
        c"device not ready",
    ),
    (
        700,
        c"CUDA_ERROR_ILLEGAL_ADDRESS",
        c"an illegal memory access was encountered",
    ),
    (
        709,
        c"CUDA_ERROR_CONTEXT_IS_DESTROYED",
        c"context is destroyed",
    ),
    (
        CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
        c"CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
        c"part or all of the requested memory range is already mapped",
    ),
    (
        CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
        c"CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
        c"pointer does not correspond to a registered memory region",
    ),
    (800, c"CUDA_ERROR_NOT_PERMITTED", c"operation not permitted"),
    (
        CUDA_ERROR_NOT_SUPPORTED,
        c"CUDA_ERROR_NOT_SUPPORTED",
        c"operation not supported",
    ),
    (CUDA_ERROR_UNKNOWN, c"CUDA_ERROR_UNKNOWN", c"unknown error"),
];
