//! See DESIGN.md (layer `sim`). Pure: no FFI, no I/O.
#![forbid(unsafe_code)]
