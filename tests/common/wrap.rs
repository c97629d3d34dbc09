//! A device that forwards every call to another, except the ones a test changes through
//! [`Hooks`]: how its copy queues behave, and whether its reduce step works.
use hoccl::device::{Allocation, Backend, CopyQueue, DevPtr, Device, ExportHandle, FlagSlab, StreamHandle};
use hoccl::{DataType, RedOp, Result};
use std::sync::Arc;

/// What a test changes of the device it wraps (every default forwards).
pub trait Hooks: Send + Sync + 'static {
    /// The copy queue the proxy gets, made from the inner device's.
    fn copy_queue(&self, q: Box<dyn CopyQueue>) -> Box<dyn CopyQueue> {
        q
    }
    /// An error the reduce step fails with instead of running.
    fn reduce_error(&self) -> Option<hoccl::Error> {
        None
    }
}

pub struct Wrapped<H: Hooks>(pub Arc<dyn Device>, pub H);

impl<H: Hooks> Device for Wrapped<H> {
    fn backend(&self) -> Backend {
        self.0.backend()
    }
    fn ordinal(&self) -> usize {
        self.0.ordinal()
    }
    fn queue_domain(&self) -> (hoccl::Backend, usize) {
        self.0.queue_domain()
    }
    fn name(&self) -> String {
        self.0.name()
    }
    fn pci_bus_id(&self) -> String {
        self.0.pci_bus_id()
    }
    fn bind_thread(&self) -> Result<()> {
        self.0.bind_thread()
    }
    fn alloc(&self, len: usize) -> Result<DevPtr> {
        self.0.alloc(len)
    }
    fn free(&self, p: DevPtr) -> Result<()> {
        self.0.free(p)
    }
    fn allocation(&self, p: DevPtr) -> Result<Allocation> {
        self.0.allocation(p)
    }
    fn export(&self, a: &Allocation) -> Result<ExportHandle> {
        self.0.export(a)
    }
    fn import(&self, h: &ExportHandle, len: usize) -> Result<DevPtr> {
        self.0.import(h, len)
    }
    fn unimport(&self, base: DevPtr, len: usize) -> Result<()> {
        self.0.unimport(base, len)
    }
    fn alloc_flags(&self, n: usize) -> Result<FlagSlab> {
        self.0.alloc_flags(n)
    }
    fn copy_to_host(&self, dst: &mut [u8], src: DevPtr) -> Result<()> {
        self.0.copy_to_host(dst, src)
    }
    fn copy_from_host(&self, dst: DevPtr, src: &[u8]) -> Result<()> {
        self.0.copy_from_host(dst, src)
    }
    fn create_stream(&self) -> Result<StreamHandle> {
        self.0.create_stream()
    }
    fn destroy_stream(&self, s: StreamHandle) -> Result<()> {
        self.0.destroy_stream(s)
    }
    fn write_value(&self, s: StreamHandle, flag: DevPtr, v: u64) -> Result<()> {
        self.0.write_value(s, flag, v)
    }
    fn wait_value_geq(&self, s: StreamHandle, flag: DevPtr, v: u64) -> Result<()> {
        self.0.wait_value_geq(s, flag, v)
    }
    fn launch_host_fn(&self, s: StreamHandle, f: Box<dyn FnOnce() + Send>) -> Result<()> {
        self.0.launch_host_fn(s, f)
    }
    fn synchronize(&self, s: StreamHandle) -> Result<()> {
        self.0.synchronize(s)
    }
    fn stream_query(&self, s: StreamHandle) -> Result<bool> {
        self.0.stream_query(s)
    }
    fn memcpy_async(&self, s: StreamHandle, dst: DevPtr, src: DevPtr, len: usize) -> Result<()> {
        self.0.memcpy_async(s, dst, src, len)
    }
    fn fill_pattern_async(&self, s: StreamHandle, dst: DevPtr, len: usize, seed: u64) -> Result<()> {
        self.0.fill_pattern_async(s, dst, len, seed)
    }
    fn reduce_async(&self, s: StreamHandle, dst: DevPtr, srcs: &[DevPtr], count: usize, dtype: DataType, op: RedOp) -> Result<()> {
        match self.1.reduce_error() {
            Some(e) => Err(e),
            None => self.0.reduce_async(s, dst, srcs, count, dtype, op),
        }
    }
    fn copy_engine_count(&self) -> usize {
        self.0.copy_engine_count()
    }
    fn create_copy_queue(&self) -> Result<Box<dyn CopyQueue>> {
        Ok(self.1.copy_queue(self.0.create_copy_queue()?))
    }
}
