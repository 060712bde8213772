//! The state-dir lock: one process per state dir.

use super::*;

/// An exclusive lock on a state dir (`<state.dir>/onceflow.lock`, flock), held for the life
/// of the value, so two processes on one state dir fail fast instead of sharing stores.
pub(crate) struct StateDirLock {
    pub(super) _file: std::fs::File,
}

impl StateDirLock {
    /// Create `dir` if needed and lock it.
    ///
    /// # Errors
    /// [`crate::Error::Config`] naming the dir and the pid holding it, when another process
    /// has it (exit code 2: give each instance its own state dir), or when `dir` is (or
    /// lies under) a file; [`crate::Error::Io`] when the dir or lock file cannot be created.
    pub(crate) fn acquire(dir: &std::path::Path) -> Result<StateDirLock> {
        use std::io::{Read, Seek, Write};
        use std::os::unix::io::AsRawFd;
        let io = |e: std::io::Error| crate::Error::Io {
            path: dir.display().to_string(),
            source: e,
        };
        // A path that is (or runs through) a file: the user's to fix, exit 2 (a restart
        // would fail the same way).
        if let Some(file) = dir.ancestors().find(|a| a.exists()).filter(|a| !a.is_dir()) {
            return Err(crate::Error::Config(format!(
                "state.dir {}: {} is a file, not a directory",
                dir.display(),
                file.display()
            )));
        }
        std::fs::create_dir_all(dir).map_err(io)?;
        let path = dir.join("onceflow.lock");
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io)?;
        // SAFETY: flock on a file descriptor we own.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            // The user's to fix (as a port in use): exit 2, not "a restart resumes".
            return Err(crate::Error::Config(format!(
                "state.dir is locked by another onceflow process (pid {}): {}; give each instance its own state.dir",
                holder.trim(),
                dir.display()
            )));
        }
        file.set_len(0).map_err(io)?;
        file.seek(std::io::SeekFrom::Start(0)).map_err(io)?;
        write!(file, "{}", std::process::id()).map_err(io)?;
        Ok(StateDirLock { _file: file })
    }
}
