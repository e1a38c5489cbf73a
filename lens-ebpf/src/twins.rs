//! Each uprobe program comes in two sections: plain (`uprobe`, one perf link per point)
//! and `uprobe.multi` (all of a program's points in a library as one uprobe_multi link,
//! removed in one step). Userspace loads the twin the kernel can take
//! (`--uprobe-links`). Both call one body, so they cannot drift apart.

/// `uprobe_and_multi! { /// docs  name, name_m => body }`: the entry program `name` and
/// its `uprobe.multi` twin `name_m`, both `body(ctx)`.
macro_rules! uprobe_and_multi {
    ($(#[$doc:meta])* $name:ident, $multi:ident => $body:ident) => {
        $(#[$doc])*
        #[::aya_ebpf::macros::uprobe]
        pub fn $name(ctx: ::aya_ebpf::programs::ProbeContext) -> u32 {
            $body(ctx)
        }

        #[doc = concat!("`", stringify!($name), "` in a `uprobe.multi` section.")]
        #[::aya_ebpf::macros::uprobe(multi)]
        pub fn $multi(ctx: ::aya_ebpf::programs::ProbeContext) -> u32 {
            $body(ctx)
        }
    };
}

/// `uretprobe_and_multi! { /// docs  name, name_m => body }`: the return program `name`
/// and its `uretprobe.multi` twin `name_m`, both `body(ctx)`.
macro_rules! uretprobe_and_multi {
    ($(#[$doc:meta])* $name:ident, $multi:ident => $body:ident) => {
        $(#[$doc])*
        #[::aya_ebpf::macros::uretprobe]
        pub fn $name(ctx: ::aya_ebpf::programs::RetProbeContext) -> u32 {
            $body(ctx)
        }

        #[doc = concat!("`", stringify!($name), "` in a `uretprobe.multi` section.")]
        #[::aya_ebpf::macros::uretprobe(multi)]
        pub fn $multi(ctx: ::aya_ebpf::programs::RetProbeContext) -> u32 {
            $body(ctx)
        }
    };
}
