//! Host backend. Being written.
use super::*;
pub struct HostDevice;
impl HostDevice {
    pub fn new() -> Result<HostDevice> {
        Err(crate::error::Error::NoDevice { op: "HostDevice::new", what: "not built yet".into() })
    }
}
