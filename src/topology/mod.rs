//! See DESIGN.md, layer `topology`.
#![forbid(unsafe_code)]
