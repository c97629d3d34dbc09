//! See DESIGN.md (layer `plan`). Pure: no FFI, no I/O.
#![forbid(unsafe_code)]
