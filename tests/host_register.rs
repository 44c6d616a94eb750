//! Registration mode (`pinned_use_cuda_host_register:True`): ordinary pages, pre-faulted and
//! registered in chunks by several threads, unregistered chunk by chunk.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tensoralloc::config::Config;
use tensoralloc::driver::sim::SimDriver;
use tensoralloc::host::HostAllocator;

fn setup(threads: usize, chunk: usize) -> (Arc<SimDriver>, HostAllocator) {
    let sim = SimDriver::shared(1, 1 << 30).unwrap();
    let config = Config {
        pinned_use_host_register: true,
        pinned_num_register_threads: threads,
        ..Config::default()
    };
    let host = HostAllocator::new(sim.clone(), &config).with_register_chunk(chunk);
    (sim, host)
}

fn registers(sim: &SimDriver) -> (u64, u64) {
    (
        sim.counters.host_register.load(Ordering::Relaxed),
        sim.counters.host_unregister.load(Ordering::Relaxed),
    )
}

#[test]
fn the_configuration_selects_registration() {
    let config =
        Config::parse("pinned_use_cuda_host_register:True,pinned_num_register_threads:4").unwrap();
    let sim = SimDriver::shared(1, 1 << 30).unwrap();
    let host = HostAllocator::new(sim.clone(), &config);
    assert!(host.uses_host_register());
    let a = host.malloc(4096).unwrap();
    assert_eq!(registers(&sim), (1, 0));
    assert_eq!(sim.counters.host_alloc.load(Ordering::Relaxed), 0);
    host.free(a.ptr, None).unwrap();
}

#[test]
fn a_large_block_is_registered_in_chunks_no_larger_than_the_limit() {
    let (sim, host) = setup(1, 1 << 20);
    let a = host.malloc(3 << 20).unwrap();
    // 3 MiB rounds to 4 MiB: four 1 MiB registrations.
    assert_eq!(registers(&sim), (4, 0));
    host.free(a.ptr, None).unwrap();
    host.empty_cache().unwrap();
    assert_eq!(registers(&sim), (4, 4));
    assert_eq!(host.stats().driver_frees, 1);
}

#[test]
fn several_threads_fault_and_register_every_page() {
    let (sim, host) = setup(4, 1 << 20);
    let a = host.malloc(8 << 20).unwrap();
    assert_eq!(registers(&sim), (8, 0));
    // SAFETY: a live 8 MiB block owned by this test.
    let bytes = unsafe { std::slice::from_raw_parts_mut(a.ptr as *mut u8, 8 << 20) };
    assert!(
        bytes.iter().step_by(4096).all(|&b| b == 0),
        "pre-faulted pages read as zero"
    );
    bytes.fill(7);
    host.free(a.ptr, None).unwrap();
    host.empty_cache().unwrap();
    assert_eq!(registers(&sim), (8, 8));
}

#[test]
fn a_small_block_is_one_registration() {
    let (sim, host) = setup(8, 1 << 20);
    let a = host.malloc(100).unwrap();
    assert_eq!(registers(&sim), (1, 0));
    host.free(a.ptr, None).unwrap();
    host.empty_cache().unwrap();
    assert_eq!(registers(&sim), (1, 1));
}
