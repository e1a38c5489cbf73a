//! What a BPF object's crate root needs besides its programs: the panic handler (each of
//! lens-ebpf's two objects, `main.rs` and `bench.rs`, includes this module).

#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any path that could reach this; nothing runs here.
    loop {}
}
