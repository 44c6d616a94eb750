//! Memory planners for static workloads.
