//! Linux's Cross Memory Attach: copies between this process's memory and another's of the same
//! user in one system call (`process_vm_readv(2)` / `process_vm_writev(2)`), with no shared
//! mapping and no intermediate buffer. The engine's single-copy route for host memory between
//! ranks of one node is built on it.

/// Lets any process of this user read and write this process's memory through
/// `process_vm_*` where Yama would restrict it to descendants. A no-op error elsewhere (no Yama,
/// not Linux) is not a failure: the probe decides.
pub fn allow_peers() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: prctl with integer arguments; it changes no memory of this process.
        let rc = unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
        if rc != 0 {
            tracing::debug!("prctl(PR_SET_PTRACER) not taken: {}", std::io::Error::last_os_error());
        }
    }
}

/// Copies `len` bytes between `local` in this process and `remote` in process `pid`: from
/// the remote into the local range (`put` false) or from the local into the remote one.
///
/// # Safety
/// `local..local + len` is memory of this process that nothing else touches meanwhile; for a
/// put, `remote..remote + len` of process `pid` is memory that process lets be written now (a
/// registration it keeps alive, not its stack or allocator's state).
///
/// # Errors
/// The system call's error (`EPERM`, `ESRCH` for a process gone, `EFAULT` for a remote range
/// not mapped), or `WriteZero` when it stops moving bytes.
pub unsafe fn copy(pid: i32, remote: u64, local: *mut u8, len: usize, put: bool) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        let mut done = 0usize;
        while done < len {
            let l = libc::iovec {
                iov_base: local.add(done).cast(),
                iov_len: len - done,
            };
            let r = libc::iovec {
                iov_base: (remote as usize + done) as *mut libc::c_void,
                iov_len: len - done,
            };
            // A call may move fewer bytes than asked (the kernel stops at a fault or a signal
            // between pages): go on from where it stopped.
            let n = if put {
                libc::process_vm_writev(pid, &l, 1, &r, 1, 0)
            } else {
                libc::process_vm_readv(pid, &l, 1, &r, 1, 0)
            };
            match n {
                n if n > 0 => done += n as usize,
                0 => return Err(std::io::ErrorKind::WriteZero.into()),
                _ => {
                    let e = std::io::Error::last_os_error();
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (pid, remote, local, len, put);
        Err(std::io::ErrorKind::Unsupported.into())
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// This process as its own peer (always allowed): a read and a write of a range larger
    /// than a page, and an unmapped remote address refused with the system's error.
    #[test]
    fn copies_both_ways_and_reports_a_bad_address() {
        let pid = std::process::id() as i32;
        let remote: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let mut local = vec![0u8; 9_000];
        // SAFETY: both buffers are this test's, alive across the calls.
        unsafe {
            copy(
                pid,
                remote.as_ptr() as u64 + 1000,
                local.as_mut_ptr(),
                local.len(),
                false,
            )
        }
        .unwrap();
        assert_eq!(local, remote[1000..]);
        let mut target = vec![0u8; 9_000];
        local.reverse();
        unsafe { copy(pid, target.as_mut_ptr() as u64, local.as_mut_ptr(), local.len(), true) }.unwrap();
        assert_eq!(target, local);
        let e = unsafe { copy(pid, 8, local.as_mut_ptr(), 16, false) }.unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EFAULT), "{e}");
    }
}
