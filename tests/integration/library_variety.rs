//! Kernel and library variety (issue 7, item 6): libraries without the symbol, stripped,
//! with versioned symbols, aliases, mapped twice; a kernel without uprobes.
