//! The codec through the device API (`compress_async`/`decompress_async` on a stream), for
//! any `Device`: CUDA runs the kernels, the host backend the CPU fallback.
use super::Codec;
use hoccl::compress::{self, Dtype, Params};
use hoccl::device::{DevPtr, Device, StreamHandle};
use std::sync::Arc;

pub struct DeviceCodec {
    pub dev: Arc<dyn Device>,
    pub stream: StreamHandle,
    /// Bytes (times value size / 2) added to the value buffers' addresses: 1 makes them
    /// miss 16-byte alignment.
    pub shift: usize,
}

/// A device allocation freed on drop (test helper: errors on free are ignored).
pub struct Buf<'a> {
    dev: &'a dyn Device,
    base: DevPtr,
    pub ptr: DevPtr,
}

impl<'a> Buf<'a> {
    pub fn new(dev: &'a dyn Device, len: usize, shift: usize) -> Result<Buf<'a>, String> {
        let base = dev.alloc(len + shift + 16).map_err(|e| e.to_string())?;
        Ok(Buf { dev, base, ptr: base.add(shift) })
    }
}

impl Drop for Buf<'_> {
    fn drop(&mut self) {
        let _ = self.dev.free(self.base);
    }
}

impl DeviceCodec {
    pub fn new(dev: Arc<dyn Device>, shift: usize) -> DeviceCodec {
        let stream = dev.create_stream().expect("create_stream");
        DeviceCodec { dev, stream, shift }
    }

    fn read(&self, p: DevPtr, len: usize) -> Result<Vec<u8>, String> {
        let mut v = vec![0u8; len];
        self.dev.copy_to_host(&mut v, p).map_err(|e| e.to_string())?;
        Ok(v)
    }

    /// Compress then decompress on the stream with one synchronization at the end: the
    /// decoder takes the whole output buffer, since the host never learns the length.
    pub fn round_trip_on_stream(&self, dt: Dtype, data: &[u8], p: &Params) -> Result<Vec<u8>, String> {
        let d = &*self.dev;
        let n = data.len() / dt.size();
        let cap = compress::max_compressed_len(dt, n, p).map_err(|e| e.to_string())?;
        let input = Buf::new(d, data.len(), self.shift * dt.size())?;
        let packed = Buf::new(d, cap, 0)?;
        let out = Buf::new(d, data.len(), self.shift * dt.size())?;
        let words = Buf::new(d, 16, 0)?;
        d.copy_from_host(input.ptr, data).map_err(|e| e.to_string())?;
        compress::compress_async(d, self.stream, dt, input.ptr, n, packed.ptr, cap, words.ptr, p)
            .map_err(|e| e.to_string())?;
        compress::decompress_async(d, self.stream, dt, packed.ptr, cap, out.ptr, n, words.ptr.add(8))
            .map_err(|e| e.to_string())?;
        d.synchronize(self.stream).map_err(|e| e.to_string())?;
        let status = self.read(words.ptr.add(8), 4)?;
        compress::status_result(u32::from_le_bytes(status.try_into().unwrap())).map_err(|e| e.to_string())?;
        self.read(out.ptr, data.len())
    }
}

impl Codec for DeviceCodec {
    fn name(&self) -> String {
        format!("{} (shift {})", self.dev.name(), self.shift)
    }

    fn compress(&self, dt: Dtype, data: &[u8], p: &Params) -> Result<Vec<u8>, String> {
        let d = &*self.dev;
        let n = data.len() / dt.size();
        let cap = compress::max_compressed_len(dt, n, p).map_err(|e| e.to_string())?;
        let input = Buf::new(d, data.len(), self.shift * dt.size())?;
        let out = Buf::new(d, cap, 0)?;
        let len = Buf::new(d, 8, 0)?;
        d.copy_from_host(input.ptr, data).map_err(|e| e.to_string())?;
        compress::compress_async(d, self.stream, dt, input.ptr, n, out.ptr, cap, len.ptr, p)
            .map_err(|e| e.to_string())?;
        d.synchronize(self.stream).map_err(|e| e.to_string())?;
        let len = u64::from_le_bytes(self.read(len.ptr, 8)?.try_into().unwrap()) as usize;
        if len > cap {
            return Err(format!("device reported a stream of {len} bytes in a buffer of {cap}"));
        }
        self.read(out.ptr, len)
    }

    fn decompress(&self, dt: Dtype, stream: &[u8], n: usize) -> Result<Vec<u8>, String> {
        let d = &*self.dev;
        let input = Buf::new(d, stream.len(), 0)?;
        let out = Buf::new(d, n * dt.size(), self.shift * dt.size())?;
        let status = Buf::new(d, 4, 0)?;
        d.copy_from_host(input.ptr, stream).map_err(|e| e.to_string())?;
        compress::decompress_async(d, self.stream, dt, input.ptr, stream.len(), out.ptr, n, status.ptr)
            .map_err(|e| e.to_string())?;
        d.synchronize(self.stream).map_err(|e| e.to_string())?;
        let w = u32::from_le_bytes(self.read(status.ptr, 4)?.try_into().unwrap());
        compress::status_result(w).map_err(|e| e.to_string())?;
        self.read(out.ptr, n * dt.size())
    }

    fn max_block(&self, dt: Dtype) -> u32 {
        match self.dev.as_cuda() {
            Some(_) => compress::gpu::max_gpu_block(dt),
            None => compress::format::MAX_BLOCK,
        }
    }
}
