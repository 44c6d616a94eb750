//! Builds and runs `replay.cpp`: PyTorch's own CUDA caching allocator (`libc10_cuda.so` from
//! the pinned torch wheel, which `scripts/fetch-torch-headers` unpacks into `target/torch-lib`)
//! on the stand-in runtime `fake_cudart.c`, next to tensoralloc's C functions, over the call
//! lists of real snapshots. Shared by `tests/pytorch_allocator.rs` (statistics must agree)
//! and `benches/pytorch_native.rs` (time per call of both); both include `tests/support`
//! as `crate::support`.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::support::{cc, fetched_dir as fetched, root, run};
use tensoralloc::replay::snapshot::{self, TraceCall};

/// The directory holding the `libtensoralloc.so` that cargo built with the running test or
/// bench (`target/<profile>/deps`; the copy one level up is only refreshed by `cargo build`).
pub fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the running executable's path");
    let dir = exe.parent().expect("target/<profile>/deps").to_path_buf();
    assert!(
        dir.join("libtensoralloc.so").exists(),
        "{} has no libtensoralloc.so",
        dir.display()
    );
    dir
}

/// Builds the stand-in `libcudart.so.13` and the replay program in `dir`, linked against
/// `libtensoralloc.so` in `lib`. Returns the program.
pub fn build(dir: &Path, lib: &Path) -> PathBuf {
    let src = root().join("tests/pytorch_native");
    let cuda = fetched(
        "CUDA_INCLUDE_DIR",
        "cuda-include",
        "cuda_runtime_api.h",
        "scripts/fetch-cuda-headers",
    );
    let torch_include = fetched(
        "TORCH_INCLUDE_DIR",
        "torch-include",
        "c10/cuda/CUDACachingAllocator.h",
        "scripts/fetch-torch-headers",
    );
    let torch_lib = fetched(
        "TORCH_LIB_DIR",
        "torch-lib",
        "libc10_cuda.so",
        "scripts/fetch-torch-headers",
    );
    std::fs::create_dir_all(dir).unwrap();
    run(
        Command::new(cc())
            .args(["-O2", "-shared", "-fPIC", "-Wall", "-Werror"])
            .arg("-I")
            .arg(&cuda)
            .arg(src.join("fake_cudart.c"))
            .arg(src.join("stubs.c"))
            .arg("-Wl,-soname,libcudart.so.13")
            .arg(format!(
                "-Wl,--version-script={}",
                src.join("cudart.map").display()
            ))
            .arg("-o")
            .arg(dir.join("libcudart.so.13")),
        "building the stand-in libcudart.so.13",
    );
    let link = dir.join("libcudart.so");
    std::fs::remove_file(&link).ok();
    std::os::unix::fs::symlink("libcudart.so.13", &link).unwrap();
    let exe = dir.join("replay");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    // libc10_cuda.so finds libcudart.so.13 through the program's RPATH (not RUNPATH, which
    // only serves the program's own dependencies).
    let rpath = format!(
        "-Wl,--disable-new-dtags,-rpath,{}:{}:{}",
        torch_lib.display(),
        dir.display(),
        lib.display()
    );
    run(
        Command::new(cxx)
            .args(["-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror"])
            .arg("-I")
            .arg(root().join("include"))
            .arg("-isystem")
            .arg(&torch_include)
            .arg("-isystem")
            .arg(&cuda)
            .arg(src.join("replay.cpp"))
            .arg("-o")
            .arg(&exe)
            .arg("-L")
            .arg(&torch_lib)
            .args(["-lc10_cuda", "-lc10"])
            .arg("-L")
            .arg(dir)
            .arg("-lcudart")
            .arg("-L")
            .arg(lib)
            .arg("-ltensoralloc")
            .arg(rpath),
        "building the PyTorch side-by-side replay",
    );
    exe
}

/// The snapshots in `tests/data/traces/`.
pub fn traces() -> Vec<PathBuf> {
    let dir = root().join("tests/data/traces");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with(".pickle.gz"))
        .collect();
    files.sort();
    files
}

/// Writes the allocator calls of a snapshot as `replay.cpp` reads them, into `dir`: each
/// `alloc` event allocates, each `free_completed` of an address allocated in the trace frees
/// (allocations live before recording started are not recreated, and their frees skipped).
/// Returns the file.
pub fn write_ops(trace: &Path, dir: &Path) -> PathBuf {
    let t = snapshot::load(trace, 0).unwrap_or_else(|e| panic!("{}: {e}", trace.display()));
    let mut text = format!("# events {}\n", t.events.len());
    for call in t.calls().0 {
        text += &match call {
            TraceCall::Malloc { slot, size, stream } => format!("a {slot} {size} {stream}\n"),
            TraceCall::Free { slot } => format!("f {slot}\n"),
        };
    }
    let name = trace.file_name().unwrap().to_string_lossy();
    let out = dir.join(name.trim_end_matches(".pickle.gz").to_string() + ".ops");
    std::fs::write(&out, text).unwrap();
    out
}

/// Writes `ops` seeded random calls into `dir`: sizes log-uniform from 1 byte to 700 MiB
/// (both pools, oversize blocks under `max_split_size_mb`, requests past small memory
/// fractions) on four streams, and frees of random live allocations about half the time.
/// With `pools`, phases of 50–400 calls route one stream's requests to a new private pool
/// (as a CUDA graph capture or a `torch.cuda.MemPool` does); the pools are released at the
/// end. Returns the file.
pub fn write_random_ops(seed: u64, ops: usize, pools: bool, dir: &Path) -> PathBuf {
    // xorshift64*: a fixed sequence per seed, on any machine.
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move || {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_f491_4f6c_dd1d)
    };
    let (mut live, mut slots) = (Vec::new(), 0usize);
    let mut text = format!("# events {ops}\n");
    // The pool being allocated to and the calls its phase has left; pools begun so far.
    let (mut phase, mut begun) = (None::<(u64, u64)>, 0u64);
    for _ in 0..ops {
        match phase {
            None if pools && next() % 100 == 0 => {
                text += &format!("b {begun} {}\n", 3 + 7 * (next() % 4));
                phase = Some((begun, 50 + next() % 350));
                begun += 1;
            }
            Some((pool, 0)) => {
                text += &format!("e {pool}\n");
                phase = None;
            }
            Some((pool, left)) => phase = Some((pool, left - 1)),
            None => {}
        }
        if !live.is_empty() && next() % 100 < 48 {
            let k = (next() % live.len() as u64) as usize;
            text += &format!("f {}\n", live.swap_remove(k));
        } else {
            let unit = (next() >> 11) as f64 / (1u64 << 53) as f64;
            let size = ((700u64 << 20) as f64).powf(unit) as u64;
            let stream = 3 + 7 * (next() % 4);
            text += &format!("a {slots} {size} {stream}\n");
            live.push(slots);
            slots += 1;
        }
    }
    if let Some((pool, _)) = phase {
        text += &format!("e {pool}\n");
    }
    for pool in 0..begun {
        text += &format!("r {pool}\n");
    }
    let out = dir.join(format!(
        "random{seed}{}.ops",
        if pools { "-pools" } else { "" }
    ));
    std::fs::write(&out, text).unwrap();
    out
}

/// Runs the replay program over `ops` files for `rounds` rounds each, with the settings in
/// `env` (neither allocator sees the caller's); returns its status and output. tensoralloc's
/// driver is the one the caller's environment selects, else the simulated device, with
/// PyTorch's stand-in device's 80 GiB.
pub fn replay(exe: &Path, ops: &[PathBuf], rounds: u32, env: &[(&str, &str)]) -> (bool, String) {
    let mut cmd = Command::new(exe);
    cmd.args(ops).env("ROUNDS", rounds.to_string());
    cmd.env_remove("PYTORCH_CUDA_ALLOC_CONF")
        .env_remove("TENSORALLOC_CONF");
    cmd.envs(env.iter().copied());
    if std::env::var_os("TENSORALLOC_DRIVER").is_none() {
        cmd.env("TENSORALLOC_DRIVER", "sim");
    }
    cmd.env("TENSORALLOC_SIM_MEMORY", (80u64 << 30).to_string());
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", exe.display()));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// The `peak NAME TORCH OURS` lines of a replay's output: per trace, PyTorch's and
/// tensoralloc's peak reserved bytes.
pub fn peaks(out: &str) -> Vec<(String, u64, u64)> {
    out.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            match f.as_slice() {
                ["peak", name, torch, ours] => {
                    Some((name.to_string(), torch.parse().ok()?, ours.parse().ok()?))
                }
                _ => None,
            }
        })
        .collect()
}
