//! See DESIGN.md, layer `compress`.
