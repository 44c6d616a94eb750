//! Configuration: `TENSORALLOC_CONF`, falling back to `PYTORCH_CUDA_ALLOC_CONF`, with the same
//! syntax as PyTorch: comma-separated `key:value` pairs, e.g.
//! `max_split_size_mb:256,garbage_collection_threshold:0.8`.

use crate::error::{Error, Result};

/// Settings of the allocators, parsed once from the environment.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Blocks at least this large are never split (PyTorch's `max_split_size_mb`); `usize::MAX`
    /// when unset.
    pub max_split_size: usize,
    /// Fraction of device capacity above which unused cached blocks are reclaimed before
    /// asking the driver for more (PyTorch's `garbage_collection_threshold`); 0 disables it.
    pub garbage_collection_threshold: f64,
    /// Pin host memory by registering ordinary pages (`cuMemHostRegister`) instead of
    /// allocating pinned memory from the driver.
    pub pinned_use_host_register: bool,
    /// Threads that fault in and register pages when `pinned_use_host_register` is set.
    pub pinned_num_register_threads: usize,
    /// Round pinned host requests up to a power of two (PyTorch's host allocator does).
    pub pinned_round_power2: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            max_split_size: usize::MAX,
            garbage_collection_threshold: 0.0,
            pinned_use_host_register: false,
            pinned_num_register_threads: 1,
            pinned_round_power2: true,
        }
    }
}

/// Largest number of registration threads accepted.
pub(crate) const MAX_REGISTER_THREADS: usize = 128;

impl Config {
    /// Reads `TENSORALLOC_CONF`, else `PYTORCH_CUDA_ALLOC_CONF`, else the defaults.
    pub fn from_env() -> Result<Config> {
        for var in ["TENSORALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"] {
            if let Ok(v) = std::env::var(var) {
                return Config::parse(&v)
                    .map_err(|e| Error::Config(format!("{var}: {}", e.message())));
            }
        }
        Ok(Config::default())
    }

    /// Parses a configuration string. Keys that PyTorch accepts but tensoralloc does not act on
    /// (`backend`, `release_lock_on_cudamalloc`, `roundup_power2_divisions`,
    /// `expandable_segments`, `pinned_use_background_threads`) are accepted and validated;
    /// unknown keys and malformed values are errors.
    pub fn parse(text: &str) -> Result<Config> {
        let mut c = Config::default();
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (key, value) = item
                .split_once(':')
                .ok_or_else(|| Error::Config(format!("`{item}` is not a `key:value` pair")))?;
            let (key, value) = (key.trim(), value.trim());
            match key {
                "max_split_size_mb" => {
                    let mb: usize = parse_number(key, value)?;
                    // PyTorch requires more than the 20 MiB large-segment size.
                    if mb <= 20 {
                        return Err(Error::Config(format!("max_split_size_mb must be more than 20, got {value}")));
                    }
                    c.max_split_size = mb.checked_mul(1 << 20).ok_or_else(|| {
                        Error::Config(format!("max_split_size_mb={value} is too large"))
                    })?;
                }
                "garbage_collection_threshold" => {
                    let t: f64 = value.parse().map_err(|_| bad(key, value, "a number"))?;
                    if !(t > 0.0 && t < 1.0) {
                        return Err(Error::Config(format!(
                            "garbage_collection_threshold must be between 0.0 and 1.0, got {value}"
                        )));
                    }
                    c.garbage_collection_threshold = t;
                }
                "pinned_use_cuda_host_register" => c.pinned_use_host_register = parse_bool(key, value)?,
                "pinned_num_register_threads" => {
                    let n: usize = parse_number(key, value)?;
                    if n == 0 || n > MAX_REGISTER_THREADS || !n.is_power_of_two() {
                        return Err(Error::Config(format!(
                            "pinned_num_register_threads must be a power of two from 1 to {MAX_REGISTER_THREADS}, got {value}"
                        )));
                    }
                    c.pinned_num_register_threads = n;
                }
                "expandable_segments" | "release_lock_on_cudamalloc" | "pinned_use_background_threads" => {
                    parse_bool(key, value)?;
                }
                "backend" => {
                    if value != "native" && value != "cudaMallocAsync" {
                        return Err(bad(key, value, "`native` or `cudaMallocAsync`"));
                    }
                }
                "roundup_power2_divisions" => {
                    // A number, or a bracketed list `[256:1,512:2,>:4]`.
                    if value.starts_with('[') {
                        if !value.ends_with(']') {
                            return Err(bad(key, value, "a number or a bracketed list"));
                        }
                    } else {
                        let _: usize = parse_number(key, value)?;
                    }
                }
                _ => {
                    return Err(Error::Config(format!(
                        "unknown option `{key}` (known: max_split_size_mb, garbage_collection_threshold, \
                         pinned_use_cuda_host_register, pinned_num_register_threads, expandable_segments, \
                         roundup_power2_divisions, backend, release_lock_on_cudamalloc)"
                    )))
                }
            }
        }
        Ok(c)
    }
}

fn bad(key: &str, value: &str, want: &str) -> Error {
    Error::Config(format!("{key}:{value}: the value must be {want}"))
}

fn parse_number<T: std::str::FromStr>(key: &str, value: &str) -> Result<T> {
    value.parse().map_err(|_| bad(key, value, "a whole number"))
}

fn parse_bool(key: &str, value: &str) -> Result<bool> {
    match value {
        "True" | "true" | "1" => Ok(true),
        "False" | "false" | "0" => Ok(false),
        _ => Err(bad(key, value, "True or False")),
    }
}

/// Parses a byte count: a plain number of bytes, or a number with a unit
/// (`B`, `KiB`/`KB`/`K`, `MiB`/`MB`/`M`, `GiB`/`GB`/`G`, `TiB`/`TB`/`T`; all binary).
pub fn parse_size(text: &str) -> Result<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| {
        Error::Config(format!(
            "`{text}` is not a size (examples: 1073741824, 512MiB, 16GiB)"
        ))
    })?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => {
            return Err(Error::Config(format!(
                "`{text}` has an unknown unit (use B, KiB, MiB, GiB or TiB)"
            )))
        }
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| Error::Config(format!("`{text}` is too large")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("16GiB").unwrap(), 16 << 30);
        assert_eq!(parse_size("1g").unwrap(), 1 << 30);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("lots").is_err());
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("99999999999999TiB").is_err());
    }

    #[test]
    fn config_parses_pytorch_syntax() {
        let c = Config::parse("max_split_size_mb:256, garbage_collection_threshold:0.6,pinned_use_cuda_host_register:True,pinned_num_register_threads:8").unwrap();
        assert_eq!(c.max_split_size, 256 << 20);
        assert_eq!(c.garbage_collection_threshold, 0.6);
        assert!(c.pinned_use_host_register);
        assert_eq!(c.pinned_num_register_threads, 8);
        assert_eq!(Config::parse("").unwrap(), Config::default());
    }

    #[test]
    fn config_rejects_bad_strings_with_a_reason() {
        for bad in [
            "max_split_size_mb",
            "max_split_size_mb:ten",
            "max_split_size_mb:4",
            "nonsense:1",
            "garbage_collection_threshold:1.5",
            "pinned_num_register_threads:3",
            "expandable_segments:maybe",
        ] {
            let e = Config::parse(bad).unwrap_err();
            assert!(matches!(e, Error::Config(_)), "{bad}");
            assert!(!e.message().is_empty());
        }
    }
}
