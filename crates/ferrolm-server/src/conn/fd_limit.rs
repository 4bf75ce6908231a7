//! The process's limit on open files. Every connection is a file descriptor, so a soft limit
//! of 1,024 (common by default) would stop accepting long before `--max-connections`.

use std::io;

/// A soft and a hard `RLIMIT_NOFILE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenFilesLimit {
    pub soft: u64,
    pub hard: u64,
}

/// Raises the soft open-files limit to the hard limit when it is lower. Returns the limit
/// before and after.
#[cfg(unix)]
pub fn raise_open_files_limit() -> io::Result<(OpenFilesLimit, OpenFilesLimit)> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one `rlimit` through a pointer to a live local.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let before = OpenFilesLimit { soft: to_u64(limit.rlim_cur), hard: to_u64(limit.rlim_max) };
    if limit.rlim_cur >= limit.rlim_max {
        return Ok((before, before));
    }
    let raised = libc::rlimit { rlim_cur: limit.rlim_max, rlim_max: limit.rlim_max };
    // SAFETY: setrlimit reads one `rlimit` through a pointer to a live local.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((before, OpenFilesLimit { soft: before.hard, hard: before.hard }))
}

/// Without `setrlimit` there is nothing to raise.
#[cfg(not(unix))]
pub fn raise_open_files_limit() -> io::Result<(OpenFilesLimit, OpenFilesLimit)> {
    Err(io::Error::new(io::ErrorKind::Unsupported, "open-files limits are a Unix notion"))
}

/// `rlim_t` is 64 bits wide on every Unix Rust supports.
#[cfg(unix)]
#[allow(clippy::unnecessary_cast, clippy::useless_conversion)]
fn to_u64(value: libc::rlim_t) -> u64 {
    value as u64
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_reaches_the_hard_limit() -> io::Result<()> {
        let (before, after) = raise_open_files_limit()?;
        assert_eq!(after.hard, before.hard);
        assert_eq!(after.soft, before.soft.max(before.hard));
        let (again, same) = raise_open_files_limit()?;
        assert_eq!(again, after, "the limit stays raised");
        assert_eq!(same, after);
        Ok(())
    }
}
