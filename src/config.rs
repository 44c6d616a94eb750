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
    /// PyTorch's `garbage_collection_threshold`: once a memory fraction is set, the share of
    /// the bytes it allows above which whole cached segments are returned, oldest first,
    /// before asking the driver for more ([`crate::device`]'s `gc` module); 0 disables it.
    pub garbage_collection_threshold: f64,
    /// PyTorch's `per_process_memory_fraction`: below 1.0, each device starts with this memory
    /// fraction set, as if `set_per_process_memory_fraction` had been called.
    pub per_process_memory_fraction: f64,
    /// PyTorch's `large_segment_size_mb`: the segment (and expandable page) size for
    /// large-pool requests under 10 MiB; 20 MiB by default.
    pub large_segment_size: usize,
    /// PyTorch's `max_non_split_rounding_mb`: how much larger than an oversize request a
    /// cached oversize block may be and still serve it; the large segment size when `None`.
    pub max_non_split_rounding: Option<usize>,
    /// Pin host memory by registering ordinary pages (`cuMemHostRegister`) instead of
    /// allocating pinned memory from the driver.
    pub pinned_use_host_register: bool,
    /// Threads that fault in and register pages when `pinned_use_host_register` is set.
    pub pinned_num_register_threads: usize,
    /// Round pinned host requests up to a power of two (PyTorch's host allocator does).
    pub pinned_round_power2: bool,
    /// PyTorch's `roundup_power2_divisions`: for each size interval (see
    /// [`Config::divisions_for`]), how many equal steps each power-of-two range is cut into when
    /// rounding device requests; 0 or 1 rounds to 512 B only.
    pub roundup_power2_divisions: [usize; ROUNDUP_INTERVALS],
    /// PyTorch's `expandable_segments`: one virtual address range per stream and pool, grown
    /// and shrunk by mapping pages, instead of one driver allocation per segment.
    pub expandable_segments: bool,
    /// Which rules place, grow and reuse device memory (`policy:pytorch`, the default, or
    /// `policy:compact`).
    pub policy: Policy,
}

/// The placement and reuse rules of the device allocator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// PyTorch's CUDACachingAllocator rules, byte for byte.
    #[default]
    PyTorch,
    /// tensoralloc's own: expandable segments with pages of the driver's granularity, and
    /// free pages of any stream reused by others once their work has completed.
    Compact,
}

/// Number of size intervals of `roundup_power2_divisions`: below 2 MiB, then one per power of
/// two from 2 MiB to 32 GiB and above.
pub(crate) const ROUNDUP_INTERVALS: usize = 16;

impl Default for Config {
    fn default() -> Self {
        Config {
            max_split_size: usize::MAX,
            garbage_collection_threshold: 0.0,
            per_process_memory_fraction: 1.0,
            large_segment_size: crate::device::size::LARGE_BUFFER,
            max_non_split_rounding: None,
            pinned_use_host_register: false,
            pinned_num_register_threads: 1,
            pinned_round_power2: true,
            roundup_power2_divisions: [0; ROUNDUP_INTERVALS],
            expandable_segments: false,
            policy: Policy::PyTorch,
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
    /// (`backend`, `release_lock_on_cudamalloc`, `pinned_use_background_threads`) are accepted
    /// and validated;
    /// unknown keys and malformed values are errors.
    pub fn parse(text: &str) -> Result<Config> {
        let mut c = Config::default();
        for item in split_top_level(text)
            .into_iter()
            .map(str::trim)
            .filter(|s| !s.is_empty())
        {
            let (key, value) = item
                .split_once(':')
                .ok_or_else(|| Error::Config(format!("`{item}` is not a `key:value` pair")))?;
            let (key, value) = (key.trim(), value.trim());
            match key {
                "max_split_size_mb" => c.max_split_size = parse_mib(key, value)?,
                "max_non_split_rounding_mb" => {
                    c.max_non_split_rounding = Some(parse_mib(key, value)?)
                }
                "large_segment_size_mb" => {
                    let bytes = parse_mib(key, value)?;
                    if bytes <= 10 << 20 || bytes > crate::device::size::MAX_REQUEST {
                        return Err(Error::Config(format!(
                            "large_segment_size_mb must be more than 10 and at most {} (1 PiB), \
                             got {value}",
                            crate::device::size::MAX_REQUEST >> 20
                        )));
                    }
                    c.large_segment_size = bytes;
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
                "per_process_memory_fraction" => {
                    let f: f64 = value.parse().map_err(|_| bad(key, value, "a number"))?;
                    if !(0.0..=1.0).contains(&f) {
                        return Err(Error::Config(format!(
                            "per_process_memory_fraction must be between 0.0 and 1.0, got {value}"
                        )));
                    }
                    c.per_process_memory_fraction = f;
                }
                "expandable_segments" => c.expandable_segments = parse_bool(key, value)?,
                "policy" => {
                    c.policy = match value {
                        "pytorch" => Policy::PyTorch,
                        "compact" => Policy::Compact,
                        _ => return Err(bad(key, value, "`pytorch` or `compact`")),
                    }
                }
                "release_lock_on_cudamalloc"
                | "release_lock_on_hipmalloc"
                | "pinned_use_background_threads"
                | "pinned_use_hip_host_register"
                | "graph_capture_record_stream_reuse" => {
                    parse_bool(key, value)?;
                }
                "pinned_reserve_segment_size_mb" => {
                    parse_number::<usize>(key, value)?;
                }
                "backend" => {
                    if value != "native" && value != "cudaMallocAsync" {
                        return Err(bad(key, value, "`native` or `cudaMallocAsync`"));
                    }
                }
                "roundup_power2_divisions" => c.roundup_power2_divisions = parse_divisions(value)?,
                _ => {
                    return Err(Error::Config(format!(
                        "unknown option `{key}` (known: max_split_size_mb, garbage_collection_threshold, \
                         pinned_use_cuda_host_register, pinned_num_register_threads, expandable_segments, \
                         policy, roundup_power2_divisions, per_process_memory_fraction, \
                         large_segment_size_mb, max_non_split_rounding_mb, backend, \
                         release_lock_on_cudamalloc, release_lock_on_hipmalloc, \
                         pinned_use_background_threads, pinned_use_hip_host_register, \
                         graph_capture_record_stream_reuse, pinned_reserve_segment_size_mb)"
                    )))
                }
            }
        }
        // As in PyTorch: nothing at least one large segment in size may be split, and an
        // oversize block may exceed a request by at least a large segment.
        let lss_mb = c.large_segment_size >> 20;
        if c.max_split_size != usize::MAX && c.max_split_size < c.large_segment_size {
            return Err(Error::Config(format!(
                "max_split_size_mb must be at least the large segment size ({lss_mb} MiB), got {}",
                c.max_split_size >> 20
            )));
        }
        if let Some(r) = c
            .max_non_split_rounding
            .filter(|&r| r < c.large_segment_size)
        {
            return Err(Error::Config(format!(
                "max_non_split_rounding_mb must be at least the large segment size ({lss_mb} MiB), got {}",
                r >> 20
            )));
        }
        Ok(c)
    }

    /// How much larger than an oversize request a cached oversize block may be.
    pub fn non_split_rounding(&self) -> usize {
        self.max_non_split_rounding
            .unwrap_or(self.large_segment_size)
    }
}

impl Config {
    /// The `roundup_power2_divisions` setting that applies to a request of `size` bytes.
    pub fn divisions_for(&self, size: usize) -> usize {
        self.roundup_power2_divisions[roundup_interval(size)]
    }
}

/// The `roundup_power2_divisions` interval of a size: 0 below 2 MiB, then `log2(size / 1 MiB)`,
/// capped at the last interval.
pub fn roundup_interval(size: usize) -> usize {
    let log = (usize::BITS - 1).saturating_sub(size.max(1).leading_zeros()) as usize;
    log.saturating_sub(20).min(ROUNDUP_INTERVALS - 1)
}

/// Splits on commas outside brackets, so `a:1,b:[x:1,y:2]` is two items.
fn split_top_level(text: &str) -> Vec<&str> {
    let (mut items, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, ch) in text.char_indices() {
        match ch {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&text[start..]);
    items
}

/// Parses `roundup_power2_divisions`: one number for every size, or a list such as
/// `[256:1,512:2,>:8]` read the way PyTorch reads it. A key is a size in MiB (a power of two)
/// and names the interval that starts there (256: requests from 256 MiB up to 512 MiB); the
/// first key's value also covers every smaller request, `>` covers every interval above the
/// last key, and intervals the list skips keep no rounding. So `[256:1,512:2,>:8]` leaves
/// requests below 512 MiB alone, cuts 512 MiB–1 GiB into 2 steps and larger ones into 8.
/// Values are 0, 1 or powers of two.
fn parse_divisions(value: &str) -> Result<[usize; ROUNDUP_INTERVALS]> {
    const KEY: &str = "roundup_power2_divisions";
    // Steps are at least 512 bytes, so more divisions than 512-byte blocks in the largest
    // request change nothing (and their product with the block size could overflow).
    const MOST: usize = crate::device::size::MAX_REQUEST / crate::device::size::MIN_BLOCK_SIZE;
    let check = |n: usize| -> Result<usize> {
        if n > 1 && !n.is_power_of_two() {
            return Err(Error::Config(format!(
                "{KEY}: {n} divisions: use 0, 1 or a power of two"
            )));
        }
        if n > MOST {
            return Err(Error::Config(format!(
                "{KEY}: {n} divisions: at most {MOST} (finer steps than 512 bytes round nothing)"
            )));
        }
        Ok(n)
    };
    let Some(list) = value.strip_prefix('[') else {
        let n = check(parse_number(KEY, value)?)?;
        return Ok([n; ROUNDUP_INTERVALS]);
    };
    let list = list.strip_suffix(']').ok_or_else(|| {
        bad(
            KEY,
            value,
            "a number or a bracketed list such as [256:1,512:2,>:8]",
        )
    })?;
    let mut out = [0; ROUNDUP_INTERVALS];
    let (mut last, mut first) = (0, true);
    for entry in list.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let (k, v) = entry
            .split_once(':')
            .ok_or_else(|| bad(KEY, entry, "`MiB:divisions` or `>:divisions`"))?;
        let n = check(parse_number(KEY, v.trim())?)?;
        if k.trim() == ">" {
            out[(last + 1).min(ROUNDUP_INTERVALS)..].fill(n);
            continue;
        }
        let mb: usize = parse_number(KEY, k.trim())?;
        if !mb.is_power_of_two() {
            return Err(Error::Config(format!(
                "{KEY}: the key {mb} is not a power of two (MiB)"
            )));
        }
        let at = (mb.trailing_zeros() as usize).min(ROUNDUP_INTERVALS - 1);
        if first {
            out[..at].fill(n);
            first = false;
        }
        out[at] = n;
        last = at;
    }
    Ok(out)
}

fn bad(key: &str, value: &str, want: &str) -> Error {
    Error::Config(format!("{key}:{value}: the value must be {want}"))
}

/// A size in MiB, as bytes.
fn parse_mib(key: &str, value: &str) -> Result<usize> {
    let mb: usize = parse_number(key, value)?;
    mb.checked_mul(1 << 20)
        .ok_or_else(|| Error::Config(format!("{key}={value} is too large")))
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
                "`{text}` has an unknown unit (use a whole number with B, KiB, MiB, GiB or TiB; \
                 KB, MB, GB and TB are read as binary too)"
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
    fn expandable_segments_and_the_compact_policy_are_opt_in() {
        assert!(!Config::default().expandable_segments);
        assert_eq!(Config::default().policy, Policy::PyTorch);
        let c = Config::parse("expandable_segments:True,policy:compact").unwrap();
        assert!(c.expandable_segments);
        assert_eq!(c.policy, Policy::Compact);
        assert_eq!(
            Config::parse("policy:pytorch").unwrap().policy,
            Policy::PyTorch
        );
    }

    #[test]
    fn divisions_and_segment_sizes_past_what_any_request_can_use_are_refused() {
        // 2^41 divisions of a 1 PiB request are 512-byte steps: the most that can matter.
        let most = 1usize << 41;
        let c = Config::parse(&format!("roundup_power2_divisions:{most}")).unwrap();
        assert_eq!(c.divisions_for(1 << 40), most);
        for text in [
            format!("roundup_power2_divisions:{}", most * 2),
            format!("roundup_power2_divisions:[>:{}]", 1usize << 55),
        ] {
            let e = Config::parse(&text).unwrap_err().to_string();
            assert!(e.contains("at most"), "{text}: {e}");
        }
        assert!(
            Config::parse("large_segment_size_mb:1073741824").is_ok(),
            "1 PiB"
        );
        for mb in ["1073741825", "17592186044415"] {
            let e = Config::parse(&format!("large_segment_size_mb:{mb}")).unwrap_err();
            assert!(e.to_string().contains("at most"), "{mb}: {e}");
        }
    }

    #[test]
    fn roundup_divisions_parse_as_a_number_or_a_list() {
        let c = Config::parse("roundup_power2_divisions:4").unwrap();
        assert_eq!(c.divisions_for(1 << 20), 4);
        assert_eq!(c.divisions_for(1 << 40), 4);
        let c = Config::parse("max_split_size_mb:100,roundup_power2_divisions:[256:1,512:2,>:8],garbage_collection_threshold:0.5").unwrap();
        assert_eq!(c.max_split_size, 100 << 20);
        assert_eq!(c.garbage_collection_threshold, 0.5);
        // PyTorch's reading: a key names the interval starting there.
        assert_eq!(c.divisions_for(3 << 20), 1, "below the first key");
        assert_eq!(c.divisions_for(300 << 20), 1, "256 MiB up to 512 MiB");
        assert_eq!(c.divisions_for(600 << 20), 2, "512 MiB up to 1 GiB");
        assert_eq!(c.divisions_for(1200 << 20), 8, "above the last key");
        assert_eq!(c.divisions_for(1 << 36), 8);
        let c = Config::parse("roundup_power2_divisions:[64:2,256:4]").unwrap();
        assert_eq!(c.divisions_for(100 << 20), 2, "64 MiB up to 128 MiB");
        assert_eq!(
            c.divisions_for(200 << 20),
            0,
            "a skipped interval keeps no rounding"
        );
        assert_eq!(c.divisions_for(300 << 20), 4);
        assert_eq!(
            c.divisions_for(600 << 20),
            0,
            "nothing above the last key without `>`"
        );
        assert!(Config::parse("roundup_power2_divisions:3").is_err());
        assert!(Config::parse("roundup_power2_divisions:[300:2]").is_err());
        assert!(Config::parse("roundup_power2_divisions:[256:2").is_err());
    }

    /// Every key PyTorch 2.11 reads is accepted, so a PYTORCH_CUDA_ALLOC_CONF written for it
    /// configures tensoralloc too.
    #[test]
    fn pytorchs_other_keys_are_accepted_and_validated() {
        let c = Config::parse(
            "release_lock_on_cudamalloc:True,release_lock_on_hipmalloc:False,\
             pinned_use_background_threads:True,pinned_use_hip_host_register:False,\
             graph_capture_record_stream_reuse:True,pinned_reserve_segment_size_mb:64,backend:native",
        )
        .unwrap();
        assert_eq!(c, Config::default());
        assert!(Config::parse("graph_capture_record_stream_reuse:maybe").is_err());
        assert!(Config::parse("pinned_reserve_segment_size_mb:lots").is_err());
    }

    #[test]
    fn segment_size_settings_follow_pytorchs_rules() {
        let c = Config::default();
        assert_eq!(c.large_segment_size, 20 << 20);
        assert_eq!(c.non_split_rounding(), 20 << 20);
        assert!(
            Config::parse("max_split_size_mb:20").is_ok(),
            "as large as a segment"
        );
        assert!(Config::parse("max_split_size_mb:19").is_err());
        let c = Config::parse("large_segment_size_mb:64,max_split_size_mb:64").unwrap();
        assert_eq!(c.large_segment_size, 64 << 20);
        assert_eq!(
            c.non_split_rounding(),
            64 << 20,
            "defaults to the segment size"
        );
        assert!(Config::parse("max_split_size_mb:30,large_segment_size_mb:64").is_err());
        assert!(Config::parse("large_segment_size_mb:10").is_err());
        let c = Config::parse("max_non_split_rounding_mb:100").unwrap();
        assert_eq!(c.non_split_rounding(), 100 << 20);
        assert!(Config::parse("max_non_split_rounding_mb:5").is_err());
    }

    #[test]
    fn per_process_memory_fraction_parses_between_0_and_1() {
        assert_eq!(Config::default().per_process_memory_fraction, 1.0);
        let c = Config::parse("per_process_memory_fraction:0.25").unwrap();
        assert_eq!(c.per_process_memory_fraction, 0.25);
        assert!(Config::parse("per_process_memory_fraction:1.5").is_err());
        assert!(Config::parse("per_process_memory_fraction:half").is_err());
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
            "policy:smallest",
        ] {
            let e = Config::parse(bad).unwrap_err();
            assert!(matches!(e, Error::Config(_)), "{bad}");
            assert!(!e.message().is_empty());
        }
    }
}
