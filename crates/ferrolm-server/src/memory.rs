//! Memory a burst of large requests leaves behind goes back to the system.
//!
//! A 30 MB body, its parsed prompt and its tokens are freed when the request ends, but glibc's
//! allocator keeps freed pages in its arenas: a few such requests leave the process hundreds of
//! megabytes larger for good. The server's upkeep task calls [`release_free_memory`] every few
//! seconds; elsewhere (other allocators return memory themselves) it does nothing.

/// Returns the allocator's free pages to the system (glibc's `malloc_trim`).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn release_free_memory() {
    // SAFETY: malloc_trim only releases pages the allocator holds free; it takes no pointers
    // and is safe to call from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn release_free_memory() {}
