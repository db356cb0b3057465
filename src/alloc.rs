//! The binary's global allocator: mimalloc, asked for alignment only when a type needs more
//! than any of its blocks has anyway.
//!
//! The `mimalloc` crate's allocator hands every allocation to `mi_malloc_aligned`. In
//! mimalloc 3 that takes the plain path only while the size's free list has a block, or
//! when the block size is a power of two; a buffer of 1.5 KB or a 48-byte struct otherwise
//! goes through the aligned-generic path and is over-allocated on a page marked as holding
//! aligned blocks, whose frees then take the slow path too. In callgrind that path was
//! about 20 calls and 4 000 instructions per new job. Every mimalloc block is aligned to a
//! word (block sizes are multiples of it, pages start aligned), so a layout that asks for
//! no more than that is given to `mi_malloc`, and only the rest (tokio's task cells, padded
//! to a cache line) to the aligned functions.

// The crate's one exception to `unsafe_code = "deny"`: a global allocator is an unsafe trait
// over foreign functions.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

use libmimalloc_sys as mi;

/// The alignment every block mimalloc hands out has.
const WORD: usize = std::mem::size_of::<usize>();

/// mimalloc, through its plain functions where the layout allows (see the module).
#[derive(Clone, Copy, Debug, Default)]
pub struct Allocator;

fn plain(align: usize) -> bool {
    align <= WORD
}

// SAFETY: every pointer comes from mimalloc, which meets the layout's alignment either way
// (word alignment from the plain functions, any power of two from the aligned ones), and
// `mi_free` takes blocks of both.
unsafe impl GlobalAlloc for Allocator {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: plain FFI calls; the size and alignment come from a valid layout.
        unsafe {
            if plain(layout.align()) {
                mi::mi_malloc(layout.size()).cast()
            } else {
                mi::mi_malloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as in `alloc`.
        unsafe {
            if plain(layout.align()) {
                mi::mi_zalloc(layout.size()).cast()
            } else {
                mi::mi_zalloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: `ptr` was allocated by this allocator, so by mimalloc.
        unsafe { mi::mi_free(ptr.cast::<c_void>()) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` was allocated by this allocator with `layout`'s alignment, which the
        // moved block keeps.
        unsafe {
            if plain(layout.align()) {
                mi::mi_realloc(ptr.cast::<c_void>(), new_size).cast()
            } else {
                mi::mi_realloc_aligned(ptr.cast::<c_void>(), new_size, layout.align()).cast()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every size from a byte to past mimalloc's small and medium classes, at every
    /// alignment up to a page: aligned, writable, kept by realloc, zeroed when asked.
    #[test]
    fn blocks_meet_every_layout_and_keep_their_bytes() {
        let sizes = [
            1,
            7,
            8,
            24,
            48,
            100,
            1024,
            1500,
            4096,
            70_000,
            300_000,
            5 << 20,
        ];
        for &size in &sizes {
            for shift in 0..=12 {
                let align = 1usize << shift;
                let layout = Layout::from_size_align(size, align).unwrap();
                // SAFETY: a non-zero layout; every pointer is checked, used within its
                // size and freed once with the layout it was made with.
                unsafe {
                    let p = Allocator.alloc(layout);
                    assert!(!p.is_null());
                    assert_eq!(p as usize % align, 0, "size {size}, align {align}");
                    p.write_bytes(0xA5, size);
                    let grown = Allocator.realloc(p, layout, size * 2 + 3);
                    assert!(!grown.is_null());
                    assert_eq!(
                        grown as usize % align,
                        0,
                        "realloc of {size}, align {align}"
                    );
                    assert!((0..size).all(|i| *grown.add(i) == 0xA5));
                    Allocator.dealloc(grown, Layout::from_size_align(size * 2 + 3, align).unwrap());

                    let z = Allocator.alloc_zeroed(layout);
                    assert_eq!(z as usize % align, 0);
                    assert!((0..size).all(|i| *z.add(i) == 0));
                    Allocator.dealloc(z, layout);
                }
            }
        }
    }

    /// A block freed and asked for again many times, as a request's buffers are: the free
    /// lists stay sound at the plain and the aligned path alike.
    #[test]
    fn churn_of_mixed_alignments_stays_sound() {
        let layouts: Vec<Layout> = [(48, 8), (1536, 8), (64, 16), (2000, 128), (24, 4)]
            .iter()
            .map(|&(s, a)| Layout::from_size_align(s, a).unwrap())
            .collect();
        let mut live: Vec<(*mut u8, Layout)> = Vec::new();
        for round in 0..20_000usize {
            let layout = layouts[round % layouts.len()];
            // SAFETY: as above; each block is freed exactly once, below or at the end.
            unsafe {
                let p = Allocator.alloc(layout);
                assert_eq!(p as usize % layout.align(), 0);
                p.write_bytes((round % 251) as u8, layout.size());
                live.push((p, layout));
                if round % 3 == 0 {
                    let (q, l) = live.swap_remove(round % live.len());
                    Allocator.dealloc(q, l);
                }
            }
        }
        for (p, l) in live {
            // SAFETY: still live, freed once.
            unsafe { Allocator.dealloc(p, l) }
        }
    }
}
