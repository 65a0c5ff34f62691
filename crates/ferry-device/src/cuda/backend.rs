//! [`Backend`] for CUDA devices: copies, events, launches, signals and IPC, each a driver call on
//! one of the device's streams.

use super::*;

impl Backend for CudaBackend {
    type Event = PooledEvent;

    fn devices(&self) -> usize {
        self.devs.len()
    }
    fn label(&self, d: usize) -> String {
        format!("cuda:{}", self.devs[d].ordinal)
    }
    fn describe(&self, d: usize) -> String {
        let v = &self.devs[d];
        format!(
            "cuda{} {} ({:.1} GiB pool)",
            v.ordinal,
            v.name,
            v.capacity as f64 / (1u64 << 30) as f64
        )
    }
    fn pool_bytes(&self, d: usize) -> u64 {
        self.devs[d].capacity
    }
    fn exec_streams(&self) -> usize {
        self.exec
    }
    fn peer_link(&self, a: usize, b: usize) -> bool {
        self.peer[a][b].is_some()
    }
    fn pci_address(&self, d: usize) -> Option<(u32, u8, u8)> {
        use sys::CUdevice_attribute as A;
        // SAFETY: plain driver queries on a valid device ordinal.
        unsafe {
            let dev = result::device::get(self.devs[d].ordinal as i32).ok()?;
            let q = |a| result::device::get_attribute(dev, a).ok();
            let dom = q(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?;
            let bus = q(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?;
            let slot = q(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?;
            Some((dom as u32, bus as u8, slot as u8))
        }
    }
    fn link_rank(&self, a: usize, b: usize) -> Option<u32> {
        self.peer[a][b]
    }
    unsafe fn h2d(&mut self, d: usize, s: Stream, dst: u64, src: *const u8, len: usize) -> Result<(), DeviceError> {
        self.bind(d)?;
        let src = std::slice::from_raw_parts(src, len);
        result::memcpy_htod_async(self.devs[d].base + dst, src, self.stream(d, s).cu_stream())
            .map_err(cuda_err("cuMemcpyHtoDAsync"))
    }
    unsafe fn d2h(&mut self, d: usize, s: Stream, dst: *mut u8, src: u64, len: usize) -> Result<(), DeviceError> {
        self.bind(d)?;
        let dst = std::slice::from_raw_parts_mut(dst, len);
        result::memcpy_dtoh_async(dst, self.devs[d].base + src, self.stream(d, s).cu_stream())
            .map_err(cuda_err("cuMemcpyDtoHAsync"))
    }
    unsafe fn peer(
        &mut self,
        d: usize,
        s: Stream,
        dst: u64,
        src_dev: usize,
        src: u64,
        len: usize,
    ) -> Result<(), DeviceError> {
        self.bind(d)?;
        let (dd, sd) = (&self.devs[d], &self.devs[src_dev]);
        result::memcpy_peer_async(
            dd.ctx.cu_ctx(),
            dd.base + dst,
            sd.ctx.cu_ctx(),
            sd.base + src,
            len,
            self.stream(d, s).cu_stream(),
        )
        .map_err(cuda_err("cuMemcpyPeerAsync"))
    }
    fn addr(&self, d: usize, off: u64) -> u64 {
        self.devs[d].base + off
    }
    unsafe fn copy(&mut self, d: usize, s: Stream, dst: Mem, src: Mem, len: usize) -> Result<(), DeviceError> {
        // A lone copy goes to a copy engine even when the copy kernel is on: one launch costs
        // the manager more than one `cuMemcpyAsync`, and lone pulls were slower by kernel on 2×
        // H200; the kernel pays off for batches (`copy_batch`) — and for a
        // lone pull that owes an acknowledgement, whose word it writes too (`copy_batch_acked`:
        // one launch against a copy and a stream write; its per-tile rate is not measured yet).
        self.bind(d)?;
        let (dst, src) = (self.at(d, dst)?, self.at(d, src)?);
        sys::cuMemcpyAsync(dst, src, len, self.stream(d, s).cu_stream())
            .result()
            .map_err(cuda_err("cuMemcpyAsync"))
    }
    /// The copy kernel runs a batch's copies side by side (a grid row each), so batches may
    /// hold copies up to its limit; the copy engines run them one after another.
    fn batch_copy_max(&self) -> usize {
        let kernel = self.sm_copy_bytes > 0
            && !self
                .devs
                .iter()
                .any(|d| matches!(d.copy_kernel, crate::sm_copy::CopyKernel::Unavailable));
        let engines = 1 << 20;
        if kernel {
            engines.max(self.sm_copy_bytes as usize)
        } else {
            engines
        }
    }

    unsafe fn copy_batch_acked(
        &mut self,
        d: usize,
        s: Stream,
        ops: &[BatchCopy],
        acks: &[(Mem, u64)],
    ) -> Result<bool, DeviceError> {
        let copies: SmallVec<[(Mem, Mem, usize); 8]> = ops.iter().map(|op| (op.dst, op.src, op.len)).collect();
        // SAFETY: the caller's contract.
        unsafe { self.sm_copies(d, s, &copies, acks) }
    }
    unsafe fn copy_batch(&mut self, d: usize, s: Stream, ops: &[BatchCopy]) -> Result<(), DeviceError> {
        if self.sm_copy_bytes > 0 {
            let copies: Vec<(Mem, Mem, usize)> = ops.iter().map(|op| (op.dst, op.src, op.len)).collect();
            // SAFETY: the caller's contract.
            if unsafe { self.sm_copies(d, s, &copies, &[])? } {
                return Ok(());
            }
        }
        // cudarc loads each symbol on first call and panics on a missing one: probe it once.
        // SAFETY: looking a symbol up in the loaded driver library calls nothing.
        let batch = *self
            .batch
            .get_or_insert_with(|| unsafe { sys::culib().get::<*const ()>(b"cuMemcpyBatchAsync_v2\0") }.is_ok());
        if !batch || ops.len() < 2 {
            return crate::copy_each(self, d, s, ops);
        }
        self.bind(d)?;
        let mut dsts = Vec::with_capacity(ops.len());
        let mut srcs = Vec::with_capacity(ops.len());
        let mut sizes = Vec::with_capacity(ops.len());
        for op in ops {
            dsts.push(self.at(d, op.dst)?);
            srcs.push(self.at(d, op.src)?);
            sizes.push(op.len);
        }
        // One attribute for all copies: sources are read in stream order (after the work
        // already on the stream). Location hints apply only to managed and pageable memory,
        // which a pool never is.
        let here = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: self.devs[d].ordinal as std::ffi::c_int,
        };
        let mut attrs = [sys::CUmemcpyAttributes {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: here,
            dstLocHint: here,
            flags: 0,
        }];
        let mut attr_idx = [0usize];
        let stream = self.stream(d, s).cu_stream();
        // SAFETY: the caller keeps every range alive and in bounds (the trait contract); the
        // arrays outlive the call, which copies them.
        let r = unsafe {
            sys::cuMemcpyBatchAsync_v2(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                ops.len(),
                attrs.as_mut_ptr(),
                attr_idx.as_mut_ptr(),
                1,
                stream,
            )
        };
        match r {
            sys::CUresult::CUDA_SUCCESS => Ok(()),
            // Refused as a whole (nothing enqueued): this driver cannot batch these copies; one
            // by one from now on.
            sys::CUresult::CUDA_ERROR_NOT_SUPPORTED | sys::CUresult::CUDA_ERROR_INVALID_VALUE => {
                tracing::info!(device = d, error = ?r, "cuMemcpyBatchAsync refused a batch: copies go one by one");
                self.batch = Some(false);
                crate::copy_each(self, d, s, ops)
            }
            e => Err(cuda_err("cuMemcpyBatchAsync")(result::DriverError(e))),
        }
    }
    fn write_signal(&mut self, d: usize, s: Stream, at: Mem, value: u64) -> Result<(), DeviceError> {
        self.check_mem_ops()?;
        self.bind(d)?;
        let addr = self.at(d, at)?;
        if addr % 8 != 0 {
            return Err(DeviceError::Body("misaligned signal word".into()));
        }
        // A signal word of this device's own area is mirrored into host memory for the node's
        // other ranks, right behind it (`signal_mirror.rs`).
        let mirror = match at {
            Mem::Pool(off) => off
                .checked_sub(crate::signal_offset(self.devs[d].capacity, 0))
                .map(|i| i / 8)
                .filter(|&slot| slot < crate::SIGNAL_SLOTS as u64)
                .and_then(|slot| Some(self.devs[d].mirror.get()?.as_ref()?.device_word(slot as usize))),
            _ => None,
        };
        let stream = self.stream(d, s).cu_stream();
        for addr in std::iter::once(addr).chain(mirror) {
            // SAFETY: a word of this device's signal area or of a mapped peer pool (the
            // transfer layer checked the word against the peer's published pool), or its host
            // mirror, registered and mapped for this device; on a live stream. The default flag
            // puts a memory barrier before the write: the work before it on the stream is
            // visible to whoever sees the value.
            unsafe {
                sys::cuStreamWriteValue64_v2(
                    stream,
                    addr,
                    value,
                    sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as std::ffi::c_uint,
                )
            }
            .result()
            .map_err(cuda_err("cuStreamWriteValue64"))?;
        }
        Ok(())
    }
    fn wait_signal(&mut self, d: usize, s: Stream, at: Mem, value: u64) -> Result<(), DeviceError> {
        self.check_mem_ops()?;
        self.bind(d)?;
        let addr = self.at(d, at)?;
        // SAFETY: a mapped address on a live stream (the transfer layer checked the offset
        // against the peer's published pool).
        unsafe {
            sys::cuStreamWaitValue64_v2(
                self.stream(d, s).cu_stream(),
                addr,
                value,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as std::ffi::c_uint,
            )
        }
        .result()
        .map_err(cuda_err("cuStreamWaitValue64"))
    }
    fn signal_mirror_export(&self, d: usize) -> Option<Vec<u8>> {
        self.bind(d).ok()?;
        // Only the ranks of this node, which map the pool, read it (`signal_mirror.rs`). Without
        // one, their pulls wait on the device.
        let mirror = self.devs[d].mirror.get_or_init(|| {
            SignalMirror::new(&self.devs[d].ctx)
                .map_err(|e| tracing::info!(device = d, error = %e, "no host mirror of the signal words: offered pulls wait on the device"))
                .ok()
        });
        mirror
            .as_ref()
            .and_then(SignalMirror::handle)
            .map(|m| m.to_bytes().to_vec())
    }
    fn ipc_attach(
        &mut self,
        d: usize,
        base: u64,
        pool_bytes: u64,
        mirror: Option<&[u8]>,
    ) -> Result<usize, DeviceError> {
        if d >= self.devs.len() {
            return Err(DeviceError::Body(format!(
                "device {d} is not one of {}",
                self.devs.len()
            )));
        }
        let published = match mirror {
            None => None,
            Some(m) => Some(ShmHandle::from_bytes(m).ok_or_else(|| {
                DeviceError::Body(format!(
                    "signal mirror handle of {} bytes (expected {})",
                    m.len(),
                    ShmHandle::BYTES
                ))
            })?),
        };
        // A mirror that cannot be mapped costs speed only: its pulls wait on the device.
        let mirrored = published.and_then(|m| {
            PeerMirror::open(m, crate::signal_offset(pool_bytes, 0))
                .map_err(|e| tracing::info!(device = d, error = %e, "a peer's signal mirror cannot be mapped: its pulls wait on the device"))
                .ok()
        });
        let mirror_missing = published.is_some() && mirrored.is_none();
        self.remote.push(RemotePool {
            dev: d,
            base,
            mirror: mirrored,
            mirror_missing,
        });
        Ok(self.remote.len() - 1)
    }
    fn ipc_mirror_missing(&self, remote: usize) -> bool {
        self.remote.get(remote).is_some_and(|r| r.mirror_missing)
    }
    fn publishes_signal_mirror(&self, d: usize) -> bool {
        self.devs[d].mirror.get().is_some_and(Option::is_some)
    }
    fn signal_mirror(&self, d: usize, at: Mem) -> Option<*const AtomicU64> {
        match at {
            Mem::Remote { pool, off } => self.remote.get(pool).filter(|r| r.dev == d)?.mirror.as_ref()?.word(off),
            _ => None,
        }
    }
    fn record(&mut self, d: usize, s: Stream) -> Result<PooledEvent, DeviceError> {
        self.bind(d)?;
        let (pool, flags) = if self.timing {
            (self.devs[d].timed_events.clone(), sys::CUevent_flags::CU_EVENT_DEFAULT)
        } else {
            (self.devs[d].events.clone(), sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
        };
        // SAFETY: a stream of this device's context, bound above, where the pool's events live.
        unsafe { PooledEvent::record(&pool, flags, self.stream(d, s).cu_stream()) }
    }
    fn done(&mut self, e: &PooledEvent) -> Result<bool, DeviceError> {
        e.is_complete()
    }
    fn enable_timing(&mut self) {
        self.timing = true;
    }
    fn elapsed_us(&mut self, a: &PooledEvent, b: &PooledEvent) -> Result<Option<f64>, DeviceError> {
        // SAFETY: live events; the driver checks that both were timed and have completed.
        let ms = unsafe { result::event::elapsed(a.ev, b.ev) }.map_err(cuda_err("cuEventElapsedTime"))?;
        Ok(Some(f64::from(ms) * 1e3))
    }
    fn synchronize(&mut self, e: &PooledEvent) -> Result<(), DeviceError> {
        // SAFETY: a live event.
        unsafe { result::event::synchronize(e.ev) }.map_err(cuda_err("cuEventSynchronize"))
    }
    fn sync_stream(&mut self, d: usize, s: Stream) -> Result<(), DeviceError> {
        self.bind(d)?;
        // Not through an event: recording one may be what just failed.
        self.stream(d, s).synchronize().map_err(cuda_err("cuStreamSynchronize"))
    }
    fn wait(&mut self, d: usize, s: Stream, e: &PooledEvent) -> Result<(), DeviceError> {
        self.bind(d)?;
        // SAFETY: a live stream and event.
        unsafe {
            result::stream::wait_event(
                self.stream(d, s).cu_stream(),
                e.ev,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(cuda_err("cuStreamWaitEvent"))
    }
    fn launch(&mut self, s: Stream, l: Launch) -> Result<(), DeviceError> {
        let d = l.device;
        self.bind(d)?;
        let Stream::Exec(k) = s else {
            return Err(DeviceError::Body("kernels run on exec streams only".into()));
        };
        let dev = &self.devs[d];
        let ctx = CudaTaskContext {
            stream: &dev.streams[s.index()],
            tiles: &l.tiles,
            args: &l.args,
            seq: l.seq,
            device: d,
            resources: &dev.resources[k],
            lanes: &dev.streams[Stream::Exec(0).index()..],
            lane_resources: &dev.resources,
            lane: k,
            read: Default::default(),
        };
        // A panicking body is the task's failure, not the GPU manager's: unwinding into the
        // manager's loop would end the thread that owns every stream of the rank (CPU bodies
        // are caught the same way, in `run_body`).
        let name = l.kernel.name();
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| l.kernel.run_cuda(&ctx))) {
            Ok(None) => Err(DeviceError::Body(format!("class `{name}` has no CUDA body"))),
            Ok(Some(r)) => r.map_err(|e| DeviceError::Body(format!("`{name}`: {e}"))),
            Err(p) => Err(DeviceError::Body(format!(
                "`{name}`: panicked: {}",
                ferry_base::error::panic_message(&*p)
            ))),
        }
    }
    fn take_launch_error(&mut self, _d: usize, _seq: u64) -> Option<String> {
        None
    }
}
