//! See DESIGN.md, layer `comm`.
